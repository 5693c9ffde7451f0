"""The few places where falcon-vllm touches vLLM internals, all installed and checked here.

1. ``ModelRegistry``: the drafter architecture ``EagleFalconForCausalLM`` (lazy import string).
2. ``EngineArgs.create_speculative_config``: accepts ``"method": "falcon"``, validates the Falcon
   options and the drafter (:mod:`falcon_vllm.vllm.options`), hands vLLM the same config with
   ``method="eagle"`` (draft KV cache, hidden-state hand-off, rejection sampling and metrics all
   come from the EAGLE plumbing) and tags the draft ``hf_config.falcon`` so workers know.
3. ``EngineArgs.add_cli_args`` / ``from_cli_args``: ``--speculative-model`` and
   ``--num-speculative-tokens`` (the older CLI form).
4. ``vllm.v1.worker.gpu_model_runner.EagleProposer`` (the name the V1 runner instantiates for
   ``method == "eagle"``): :class:`falcon_vllm.vllm.proposer.FalconProposer`, which delegates to
   stock EAGLE unless the draft config is Falcon's.

``install()`` first checks that every internal the plugin relies on is still where it expects;
if vLLM moved one, it fails at start-up naming the supported range instead of silently running
stock EAGLE.  A second guard at run time: the Falcon drafter refuses to be run by any proposer but
``FalconProposer``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

SUPPORTED_RANGE = "vllm>=0.32,<0.34"
DRAFTER_ARCH = "EagleFalconForCausalLM"
EAGLE_D2T_ARCH = "EagleD2TLlamaForCausalLM"  # vLLM's EAGLE-1 with a truncated head (the baseline's)

# what FalconProposer uses of vLLM's proposer and attention metadata
_PROPOSER_METHODS = ("propose", "load_model", "initialize_attn_backend", "set_inputs_first_pass",
                     "build_per_group_and_layer_attn_metadata",
                     "_get_slot_mapping", "_get_positions")
_PROPOSE_ARGS = ("num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
                 "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata",
                 "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings")
_CAD_FIELDS = ("query_start_loc", "query_start_loc_cpu", "seq_lens", "num_actual_tokens", "max_query_len",
               "max_seq_len", "block_table_tensor", "slot_mapping", "causal", "seq_lens_cpu_upper_bound",
               "positions", "_num_computed_tokens_cache", "_token_to_req_indices_cache")


class VllmVersionError(RuntimeError):
    pass


def _fail(what: str):
    import vllm

    raise VllmVersionError(f"falcon-vllm supports {SUPPORTED_RANGE}; with vllm {vllm.__version__} {what}. "
                           "Install a supported vLLM, or disable the plugin with VLLM_PLUGINS=''")


def _check_version() -> None:
    import vllm

    ver = getattr(vllm, "__version__", "0")
    try:
        major, minor = (int(x) for x in ver.split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    if not (0, 32) <= (major, minor) < (0, 34):
        _fail("the plugin cannot run")


def _check_internals() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.spec_decode.eagle import EagleProposer
    import vllm.v1.worker.gpu_model_runner as gmr

    for cls, name in ((EngineArgs, "create_speculative_config"), (EngineArgs, "add_cli_args"),
                      (EngineArgs, "from_cli_args"), (AsyncEngineArgs, "add_cli_args")):
        if not callable(getattr(cls, name, None)):
            _fail(f"{cls.__name__}.{name} is missing")
    if "speculative_config" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        _fail("EngineArgs has no speculative_config field")
    if not isinstance(getattr(gmr, "EagleProposer", None), type) or not issubclass(gmr.EagleProposer, EagleProposer):
        _fail("vllm.v1.worker.gpu_model_runner no longer instantiates EagleProposer by name")
    missing = [m for m in _PROPOSER_METHODS if not callable(getattr(EagleProposer, m, None))]
    if missing:
        _fail(f"EagleProposer lacks {missing}")
    params = inspect.signature(EagleProposer.propose).parameters
    if [p for p in params if p != "self"] != list(_PROPOSE_ARGS):
        _fail(f"EagleProposer.propose has a new signature {list(params)}")
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    if missing := [f for f in _CAD_FIELDS if f not in fields]:
        _fail(f"CommonAttentionMetadata lacks {missing}")
    # tree mode (falcon_vllm.vllm.tree_mode) wraps these
    for name in ("_prepare_inputs", "_sample", "sample_tokens", "take_draft_token_ids", "propose_draft_token_ids",
                 "_copy_valid_sampled_token_count"):
        if not callable(getattr(gmr.GPUModelRunner, name, None)):
            _fail(f"GPUModelRunner.{name} is missing")
    if "hidden_states" not in getattr(gmr.ExecuteModelState, "_fields", ()):
        _fail("ExecuteModelState has no hidden_states")
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    sd_fields = {f.name for f in dataclasses.fields(SpecDecodeMetadata)}
    if missing := [f for f in ("draft_token_ids", "num_draft_tokens") if f not in sd_fields]:
        _fail(f"SpecDecodeMetadata lacks {missing}")


def install() -> None:
    _check_version()
    _check_internals()
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs

    if DRAFTER_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(DRAFTER_ARCH, "falcon_vllm.vllm.model:EagleFalconForCausalLM")
    if EAGLE_D2T_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(EAGLE_D2T_ARCH, "falcon_vllm.vllm.model:EagleD2TLlamaForCausalLM")
    _wrap_create_speculative_config(EngineArgs)
    _wrap_cli(EngineArgs)
    _swap_proposer()
    _wrap_propose_draft_token_ids()
    from falcon_vllm.vllm import tree_mode

    tree_mode.install()


# ---------------------------------------------------------------------- config
def _wrap_create_speculative_config(EngineArgs):
    orig = EngineArgs.create_speculative_config
    if getattr(orig, "_falcon", False):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        sc = self.speculative_config
        shortcuts = {"method": getattr(self, "spec_method", None), "model": getattr(self, "spec_model", None),
                     "num_speculative_tokens": getattr(self, "spec_tokens", None)}
        method = (sc or {}).get("method") if isinstance(sc, dict) else None
        if "falcon" not in (method, shortcuts["method"]):
            return orig(self, target_model_config, target_parallel_config)
        merged = dict(sc or {})
        for key, value in shortcuts.items():  # --spec-model/--spec-tokens merge as vLLM merges them
            if value is not None:
                if key in merged:
                    raise ValueError(f"--spec-{key.split('_')[-1]} and --speculative-config['{key}'] are "
                                     "mutually exclusive")
                merged[key] = value
        from vllm.config import SpeculativeConfig
        from vllm.logger import init_logger

        from falcon_vllm.vllm.options import resolve_falcon_config

        runner_env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        if runner_env is not None and runner_env.strip().lower() in ("1", "true"):
            raise ValueError("falcon: the Falcon proposer runs in vLLM's V1 model runner; unset "
                             "VLLM_USE_V2_MODEL_RUNNER (or set it to 0)")
        valid = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {
            "target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config"}
        eagle_sc, info = resolve_falcon_config(merged, target_model_config.hf_config, valid)
        saved = {name: getattr(self, name, None) for name in ("spec_method", "spec_model", "spec_tokens")}
        self.speculative_config = eagle_sc
        for name in saved:
            setattr(self, name, None)
        try:
            spec = orig(self, target_model_config, target_parallel_config)
        finally:  # leave the user's EngineArgs as given
            self.speculative_config = sc
            for name, value in saved.items():
                setattr(self, name, value)
        archs = list(getattr(spec.draft_model_config.hf_config, "architectures", None) or [])
        if DRAFTER_ARCH not in archs:
            _fail(f"the EAGLE plumbing resolved the drafter to {archs}, not {DRAFTER_ARCH}")
        hf = spec.draft_model_config.hf_config
        hf.falcon = dict(getattr(hf, "falcon", None) or {}, **info)
        log = init_logger("falcon_vllm")
        log.info("falcon-vllm: method falcon -> vLLM's EAGLE plumbing with drafter %s (k=%s, K=%d, %s mode%s)",
                 spec.draft_model_config.model, hf.falcon.get("k"), spec.num_speculative_tokens,
                 hf.falcon.get("mode"), f", tree {hf.falcon['tree_name']}" if "tree_name" in hf.falcon else "")
        if runner_env is None:  # the Falcon proposer hooks the V1 model runner (the only one on CPU)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            log.info("falcon-vllm: selecting vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        return spec

    create_speculative_config._falcon = True
    EngineArgs.create_speculative_config = create_speculative_config


# ---------------------------------------------------------------------- CLI
def _wrap_cli(EngineArgs):
    """``--speculative-model falcon|<dir>`` and ``--num-speculative-tokens N`` (older vLLM form)."""
    orig_add = EngineArgs.add_cli_args
    if getattr(orig_add, "_falcon", False):
        return

    def add_cli_args(parser, *a, **kw):
        parser = orig_add(parser, *a, **kw)
        if not any("--speculative-model" in getattr(x, "option_strings", []) for x in parser._actions):
            g = parser.add_argument_group("falcon-vllm (older speculative-decoding flags)")
            g.add_argument("--speculative-model", default=None,
                           help="'falcon' (a drafter resolved for the target: a drafter shipped with falcon-vllm "
                                "whose recorded target matches, else $FALCON_VLLM_DRAFTER) or a Falcon drafter "
                                "directory; same as --speculative-config '{\"method\": \"falcon\", \"model\": ...}'")
            g.add_argument("--num-speculative-tokens", type=int, default=None,
                           help="draft tokens per step with --speculative-model")
        return parser

    add_cli_args._falcon = True
    EngineArgs.add_cli_args = staticmethod(add_cli_args)

    orig_from = EngineArgs.__dict__["from_cli_args"].__func__  # a classmethod; AsyncEngineArgs inherits it

    def from_cli_args(klass, args):
        ea = orig_from(klass, args)
        model = getattr(args, "speculative_model", None)
        ntok = getattr(args, "num_speculative_tokens", None)
        if model is not None:
            if ea.speculative_config:
                raise ValueError("--speculative-model and --speculative-config are mutually exclusive")
            ea.speculative_config = {"method": "falcon", "model": model}
            if ntok is not None:
                ea.speculative_config["num_speculative_tokens"] = ntok
        elif ntok is not None:
            raise ValueError("--num-speculative-tokens needs --speculative-model (or use --speculative-config)")
        return ea

    EngineArgs.from_cli_args = classmethod(from_cli_args)


# ---------------------------------------------------------------------- proposer
def _swap_proposer():
    import vllm.v1.worker.gpu_model_runner as gmr

    from falcon_vllm.vllm.proposer import FalconProposer

    gmr.EagleProposer = FalconProposer


def _wrap_propose_draft_token_ids():
    """No-drafts fast path: when vLLM's dynamic speculation schedules no draft tokens for the next step
    (``num_speculative_tokens_per_batch_size``, e.g. a tune-tree fit at this batch size), a Falcon
    runner skips vLLM's drafter input preparation (next-token gather, padded-batch metadata, hidden-state
    hand-off) as well as the drafter itself, and keeps only what vLLM does when it skips a drafter
    (the valid-token count of async scheduling).  The step then costs what a vanilla step costs."""
    import torch
    import vllm.v1.worker.gpu_model_runner as gmr

    from falcon_vllm.vllm.proposer import FalconProposer

    runner_cls = gmr.GPUModelRunner
    orig = runner_cls.propose_draft_token_ids
    if getattr(orig, "_falcon", False):
        return

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if (not isinstance(drafter, FalconProposer) or not drafter.falcon
                or scheduler_output.num_spec_tokens_to_schedule != 0):
            return orig(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        if getattr(self, "valid_sampled_token_count_event", None) is not None and torch.is_tensor(sampled_token_ids):
            next_ids, counts = drafter.prepare_next_token_ids_padded(
                sampled_token_ids, self.requests, self.input_batch, self.discard_request_mask.gpu)
            self._copy_valid_sampled_token_count(next_ids, counts)
        drafter.skipped_steps += 1
        return torch.empty(self.input_batch.num_reqs, 0, dtype=torch.int64, device=self.device)

    propose_draft_token_ids._falcon = True
    runner_cls.propose_draft_token_ids = propose_draft_token_ids
