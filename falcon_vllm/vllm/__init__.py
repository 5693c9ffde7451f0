"""Everything that imports vLLM.  Only this sub-package may import vllm.

``register()`` (the ``vllm.general_plugins`` entry point, run in every vLLM process) is cheap and
idempotent: it installs :mod:`falcon_vllm.vllm.compat` (work-arounds for third-party bugs) and
:mod:`falcon_vllm.vllm.hooks` (method ``falcon``, the older CLI flags, the Falcon proposer, tree
mode).  Every vLLM internal either replaces or reads is listed in :mod:`falcon_vllm.vllm.patches`.
"""

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from falcon_vllm.vllm import compat, hooks

    compat.install()
    hooks.install()
    _registered = True
