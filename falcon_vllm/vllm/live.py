"""Which object is a runner's live Falcon proposer, and which draft config is a Falcon drafter's, for modules
the proposer itself imports and for the Model Runner V2 hook (no vLLM import).

The runner hooks (:mod:`falcon_vllm.vllm.tree_verify`, :mod:`falcon_vllm.vllm.hooks`) ask whether a
runner's ``drafter`` is a Falcon proposer running a Falcon drafter.  Proposer classes register here
(:func:`proposer_class`), so that those modules need not import the proposer's module, which imports
them.
"""

from __future__ import annotations

_CLASSES: list[type] = []


def proposer_class(cls: type) -> type:
    """Class decorator: instances of ``cls`` with a ``falcon`` section are live Falcon proposers."""
    if cls not in _CLASSES:
        _CLASSES.append(cls)
    return cls


def falcon_section(draft_model_config):
    """The draft config's serving options (:class:`~falcon_vllm.serving.Serving`, read from the ``hf_config.falcon``
    the plugin's config set-up tagged), or None: no draft model, or not a Falcon drafter."""
    if draft_model_config is None:
        return None
    f = getattr(draft_model_config.hf_config, "falcon", None)
    if not isinstance(f, dict) or "k" not in f:
        return None
    from falcon_vllm.serving import Serving

    return Serving.from_section(f)


def falcon_proposer(runner):
    """The runner's drafter when it is a Falcon proposer running a Falcon drafter (else None: vLLM's own)."""
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, tuple(_CLASSES)) and drafter.falcon else None
