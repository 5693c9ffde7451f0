"""Falcon on vLLM 0.34's Model Runner V2 (the only runner from 0.34 on): chain mode as a custom speculator.

0.34 lets a plugin add a speculative method without patching the runner::

    register_speculative_method("falcon", FalconSpeculatorConfig)   # vllm.v1.worker.gpu.spec_decode

after which ``{"method": "falcon", ...}`` is set up by :class:`~falcon_vllm.vllm.v2.config.FalconSpeculatorConfig`
and drafted by :class:`~falcon_vllm.vllm.v2.speculator.FalconSpeculator`, which the runner builds.  Tree mode is
not offered here (V2 has no tree verification; ``docs/vllm-0.34-port.md`` section 4).

On vLLM 0.32/0.33, whose Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``) builds its speculator in a hard-coded
``init_speculator``, :func:`install_runner_hook` wraps that one function instead: a Falcon drafter (the config
hook has tagged its ``hf_config.falcon``) gets the same :class:`~falcon_vllm.vllm.v2.speculator.FalconSpeculator`.

Only this package imports names that exist in vLLM 0.34 alone, and only from its submodules: importing
``falcon_vllm.vllm.v2`` itself imports no vLLM, so the plugin keeps working on 0.32/0.33.
"""

from __future__ import annotations

import sys

METHOD = "falcon"
SPEC_DECODE = "vllm.v1.worker.gpu.spec_decode"  # where V2's init_speculator lives
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"   # which imports it by name


def register() -> None:
    """Register method ``falcon`` with vLLM's V2 speculators and the drafter architecture with vLLM's model
    registry (idempotent; run in every vLLM process)."""
    try:
        from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method
    except ImportError as exc:
        import vllm

        raise RuntimeError(
            f"falcon-vllm: vLLM {getattr(vllm, '__version__', '?')} has no register_speculative_method "
            "(vllm.v1.worker.gpu.spec_decode.speculator_config, added in 0.34), so the V2 Falcon speculator "
            "cannot be registered; on vLLM 0.32/0.33 the plugin runs Falcon in the V1 model runner instead "
            "(falcon_vllm.register)") from exc
    from vllm import ModelRegistry

    from falcon_vllm.config import ARCHITECTURE
    from falcon_vllm.vllm.v2.config import FalconSpeculatorConfig

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "falcon_vllm.vllm.model:EagleFalconForCausalLM")
    register_speculative_method(METHOD, FalconSpeculatorConfig)
    from falcon_vllm.vllm.v2 import cli, ragged

    cli.install()  # the same flags and keys as on vLLM 0.32/0.33
    ragged.install()  # per-request draft lengths to the scheduler


def install_runner_hook() -> bool:
    """vLLM 0.32/0.33's Model Runner V2: build :class:`FalconSpeculator` for a Falcon drafter where the runner builds
    its speculator (``init_speculator``), vLLM's own otherwise.  True when installed now; False where vLLM has no
    V2 speculators, registers them (0.34: :func:`register`), or the hook is already in."""
    from falcon_vllm.vllm import patches
    from falcon_vllm.vllm.live import falcon_section

    try:
        spec_decode = patches.resolve(SPEC_DECODE)
    except ImportError:
        return False
    if not hasattr(spec_decode, "init_speculator") or has_registry():
        return False

    def make(orig):
        def init_speculator(vllm_config, device, req_states, *args, **kwargs):
            if falcon_section(getattr(vllm_config.speculative_config, "draft_model_config", None)) is None:
                return orig(vllm_config, device, req_states, *args, **kwargs)
            from falcon_vllm.vllm.v2.speculator import FalconSpeculator

            return FalconSpeculator(vllm_config, device, req_states)

        return init_speculator

    installed = patches.wrap(spec_decode, "init_speculator", make)
    from falcon_vllm.vllm.v2 import ragged

    ragged.install()  # per-request draft lengths to the scheduler (changes nothing without a ragged speculator)
    runner = sys.modules.get(V2_RUNNER)  # imported before the plugin: its name still points at vLLM's own
    if runner is not None and getattr(runner, "init_speculator", None) is patches.original(spec_decode,
                                                                                          "init_speculator"):
        runner.init_speculator = spec_decode.init_speculator
    return installed


def has_registry() -> bool:
    """Whether vLLM registers V2 speculators by name (0.34: ``register_speculative_method``)."""
    from falcon_vllm.vllm import patches

    try:
        return hasattr(patches.resolve(SPEC_DECODE + ".speculator_config"), "register_speculative_method")
    except ImportError:
        return False
