"""Falcon on vLLM 0.34's Model Runner V2 (the only runner from 0.34 on): chain mode as a custom speculator.

0.34 lets a plugin add a speculative method without patching the runner::

    register_speculative_method("falcon", FalconSpeculatorConfig)   # vllm.v1.worker.gpu.spec_decode

after which ``{"method": "falcon", ...}`` is set up by :class:`~falcon_vllm.vllm.v2.config.FalconSpeculatorConfig`
and drafted by :class:`~falcon_vllm.vllm.v2.speculator.FalconSpeculator`, which the runner builds.  Tree mode is
not offered here (V2 has no tree verification; ``docs/vllm-0.34-port.md`` section 4).

Only this package imports names that exist in vLLM 0.34 alone, and only from its submodules: importing
``falcon_vllm.vllm.v2`` itself imports no vLLM, so the plugin keeps working on 0.32/0.33.
"""

from __future__ import annotations

METHOD = "falcon"


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
