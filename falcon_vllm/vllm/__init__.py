"""Everything that imports vLLM.  Only this sub-package may import vllm.

``register()`` (the ``vllm.general_plugins`` entry point, run in every vLLM process) is cheap and
idempotent.  It installs, all in :mod:`falcon_vllm.vllm.hooks`:

1. the drafter architecture ``EagleFalconForCausalLM`` in vLLM's model registry (lazy import);
2. a wrapper of ``EngineArgs.create_speculative_config`` that accepts ``"method": "falcon"``,
   validates the Falcon options and the drafter, and maps it onto vLLM's EAGLE plumbing;
3. the CLI flags ``--speculative-model`` / ``--num-speculative-tokens`` (compatibility form);
4. the Falcon-aware proposer in place of the V1 runner's ``EagleProposer``.

It also installs :mod:`falcon_vllm.vllm.compat` (several engines in one process, e.g. ``ngram``
followed by another method in the benchmark harness).
"""

SUPPORTED_VLLM = (">=0.32", "<0.34")

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from falcon_vllm.vllm import compat, hooks

    compat.install()
    hooks.install()
    _registered = True
