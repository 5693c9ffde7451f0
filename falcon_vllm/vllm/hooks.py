"""The few places where falcon-vllm touches vLLM internals, checked at start-up.

Each hook names what it patches; if vLLM moved it, ``install()`` fails loudly with the supported
version range instead of silently running stock EAGLE.
"""

from __future__ import annotations

import dataclasses
import os

from falcon_vllm.vllm.options import FALCON_KEYS, resolve_falcon_config

SUPPORTED_RANGE = "vllm>=0.32,<0.34"


def _check_version():
    import vllm

    ver = getattr(vllm, "__version__", "0")
    try:
        major, minor = (int(x) for x in ver.split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    if (major, minor) < (0, 32) or (major, minor) >= (0, 34):
        raise RuntimeError(f"falcon-vllm supports {SUPPORTED_RANGE}; this is vllm {ver}. Install a "
                           "supported vLLM or disable the plugin with VLLM_PLUGINS=''")


def install() -> None:
    _check_version()
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs

    ModelRegistry.register_model("EagleFalconForCausalLM", "falcon_vllm.vllm.model:EagleFalconForCausalLM")
    _wrap_create_speculative_config(EngineArgs)
    _wrap_cli(EngineArgs)
    _swap_proposer()


# ---------------------------------------------------------------------- config
def _wrap_create_speculative_config(EngineArgs):
    orig = EngineArgs.create_speculative_config
    if getattr(orig, "_falcon", False):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        sc = self.speculative_config
        if not (isinstance(sc, dict) and sc.get("method") == "falcon"):
            return orig(self, target_model_config, target_parallel_config)
        from vllm.config import SpeculativeConfig

        valid = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {
            "target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config"}
        sc, info = resolve_falcon_config(dict(sc), target_model_config.hf_config, valid)
        self.speculative_config = sc
        spec = orig(self, target_model_config, target_parallel_config)
        archs = list(getattr(spec.draft_model_config.hf_config, "architectures", None) or [])
        if "EagleFalconForCausalLM" not in archs:
            raise RuntimeError(f"falcon-vllm: vLLM resolved the drafter to {archs}, not EagleFalconForCausalLM; "
                               f"this vLLM's EAGLE plumbing changed (supported: {SUPPORTED_RANGE})")
        spec.draft_model_config.hf_config.falcon = dict(spec.draft_model_config.hf_config.falcon, **info)
        # the Falcon proposer hooks the V1 model runner (the only runner on CPU)
        if "VLLM_USE_V2_MODEL_RUNNER" not in os.environ:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            from vllm.logger import init_logger
            init_logger("falcon_vllm").info("falcon-vllm: selecting vLLM's V1 model runner "
                                            "(VLLM_USE_V2_MODEL_RUNNER=0) for the Falcon proposer")
        return spec

    create_speculative_config._falcon = True
    EngineArgs.create_speculative_config = create_speculative_config


# ---------------------------------------------------------------------- CLI
def _wrap_cli(EngineArgs):
    """``--speculative-model falcon|<dir>`` and ``--num-speculative-tokens N`` (older vLLM form)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    orig_add = EngineArgs.add_cli_args
    if getattr(orig_add, "_falcon", False):
        return

    def add_cli_args(parser, *a, **kw):
        parser = orig_add(parser, *a, **kw)
        if not any("--speculative-model" in getattr(x, "option_strings", []) for x in parser._actions):
            g = parser.add_argument_group("falcon-vllm (compatibility form)")
            g.add_argument("--speculative-model", default=None,
                           help="'falcon' (resolve a drafter for the target) or a Falcon drafter directory; "
                                "same as --speculative-config '{\"method\": \"falcon\", \"model\": ...}'")
            g.add_argument("--num-speculative-tokens", type=int, default=None,
                           help="draft tokens per step with --speculative-model")
        return parser

    add_cli_args._falcon = True
    EngineArgs.add_cli_args = staticmethod(add_cli_args)

    for cls in (EngineArgs, AsyncEngineArgs):
        orig_from = cls.__dict__.get("from_cli_args")
        func = orig_from.__func__ if isinstance(orig_from, classmethod) else None
        if func is None or getattr(func, "_falcon", False):
            continue

        def from_cli_args(klass, args, _orig=func):
            ea = _orig(klass, args)
            model = getattr(args, "speculative_model", None)
            ntok = getattr(args, "num_speculative_tokens", None)
            if model is not None:
                if ea.speculative_config:
                    raise ValueError("--speculative-model and --speculative-config are mutually exclusive")
                ea.speculative_config = {"method": "falcon", "model": model}
                if ntok is not None:
                    ea.speculative_config["num_speculative_tokens"] = ntok
            elif ntok is not None:
                raise ValueError("--num-speculative-tokens needs --speculative-model (or use "
                                 "--speculative-config)")
            return ea

        from_cli_args._falcon = True
        setattr(cls, "from_cli_args", classmethod(from_cli_args))


# ---------------------------------------------------------------------- proposer
def _swap_proposer():
    import vllm.v1.worker.gpu_model_runner as gmr

    from falcon_vllm.vllm.proposer import FalconProposer

    if not hasattr(gmr, "EagleProposer"):
        raise RuntimeError(f"falcon-vllm: vllm.v1.worker.gpu_model_runner has no EagleProposer "
                           f"(supported: {SUPPORTED_RANGE})")
    if gmr.EagleProposer is not FalconProposer:
        gmr.EagleProposer = FalconProposer


__all__ = ["install", "FALCON_KEYS"]
