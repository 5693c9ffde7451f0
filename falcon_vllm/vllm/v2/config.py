"""``FalconSpeculatorConfig``: how vLLM 0.34 sets up method ``falcon`` (chain mode).

vLLM calls it from ``SpeculativeConfig.__post_init__`` in every process, so, as vLLM asks of speculator
configs, this module does not import the speculator (it is named by ``speculator_class``).  It subclasses
EAGLE's config and so inherits the draft ``ModelConfig`` set-up, the ``EAGLEConfig`` wrapping of the
drafter's hf_config and ``num_lookahead_tokens`` = K.  Falcon's own options go in ``speculator_options``::

    {"method": "falcon", "model": "<drafter dir>", "num_speculative_tokens": 6,
     "speculator_options": {"draft_gemm_dtype": "model"}}

:func:`falcon_vllm.vllm.options.resolve_falcon_config` validates them and resolves the drafter (a missing
``model`` picks a shipped drafter for the target) before the draft ``ModelConfig`` is built; the result is
tagged on the drafter's ``hf_config.falcon``, as on V1, and the drafter's ``serving.json`` applies as on V1
(prompt lookup, the datastore, the schedule, sampled drafts; a tune-tree file there is not taken: no tree mode on
V2 yet).  Refused with the reason (:mod:`falcon_vllm.vllm.v2.rules`): tree mode, level-embedding drafters.
"""

from __future__ import annotations

from vllm.config import SpeculativeConfig
from vllm.v1.worker.gpu.spec_decode.eagle.config import EagleSpeculatorConfig

from falcon_vllm.vllm.options import resolve_falcon_config
from falcon_vllm.vllm.v2.rules import SPEC_FIELDS, check_v2



class FalconSpeculatorConfig(EagleSpeculatorConfig):
    """Method ``falcon`` on Model Runner V2: EAGLE's set-up, Falcon's options and drafter, Falcon's speculator."""

    base_method = "eagle"
    speculator_class = "falcon_vllm.vllm.v2.speculator.FalconSpeculator"
    supported_options = frozenset({"speculator_options", "draft_lm_head_quantization"})
    parallel_drafting = False  # k tokens per pass, semi-autoregressively, ceil(K / k) passes
    supports_watermarking = False  # not checked with Falcon's block passes

    @classmethod
    def default_model(cls, spec: SpeculativeConfig) -> str | None:
        """No ``model``: :meth:`configure` resolves a drafter (EAGLE's would refuse)."""
        return None

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> None:
        given = {name: getattr(spec, name) for name in SPEC_FIELDS if getattr(spec, name) is not None}
        options = dict(spec.speculator_options or {})
        if fields := sorted(set(SPEC_FIELDS) & set(options)):
            raise ValueError(f"falcon-vllm: {fields} are fields of the speculative config: give them beside "
                             "speculator_options, not in it")
        resolved, serving = resolve_falcon_config({**given, **options}, spec.target_model_config.hf_config,
                                               set(SPEC_FIELDS))
        check_v2(serving)
        for name, value in resolved.items():  # model, num_speculative_tokens and any vLLM key it filled in
            if name != "method":
                setattr(spec, name, value)
        super().configure(spec)
        hf = spec.draft_model_config.hf_config
        hf.falcon = dict(getattr(hf, "falcon", None) or {}, **serving.section())
