"""Everything that imports vLLM.  Only this sub-package may import vllm.

``register()`` (the ``vllm.general_plugins`` entry point, run in every vLLM process) is cheap and
idempotent.  On vLLM 0.32/0.33 it installs :mod:`falcon_vllm.vllm.compat` (work-arounds for third-party
bugs) and :mod:`falcon_vllm.vllm.hooks` (method ``falcon``, the older CLI flags, the Falcon proposer of
the V1 runner, tree mode, and the speculator of Model Runner V2).  On a vLLM without the V1 runner that
registers speculators (0.34), it registers chain mode's V2 speculator instead (:func:`falcon_vllm.vllm.v2.register`,
written against 0.34's classes, not yet run on 0.34).  Every vLLM internal either replaces or reads is listed
in :mod:`falcon_vllm.vllm.patches`.
"""

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from falcon_vllm.vllm import patches, v2

    if not patches.has_v1_runner() and v2.has_registry():
        v2.register()
    else:  # hooks.install refuses a vLLM it cannot serve, naming why
        from falcon_vllm.vllm import compat, hooks

        compat.install()
        hooks.install()
    _registered = True
