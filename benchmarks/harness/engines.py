"""In-process vLLM engines for the A/B tools, and the configuration names they share.

Importing this module sets the environment every tool measures under unless the caller set it: the engine in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), 2 GiB of KV cache per engine, offline model loading.  A tool
that starts several engines sets a smaller ``VLLM_CPU_KVCACHE_SPACE`` before importing it.

Configuration names (``spec_for``)::

    vanilla                      no speculation (the usual baseline)
    falcon                       the drafter's own recommendation (its serving.json)
    chain[:K]                    Falcon's chain of K tokens
    lookup[:K[:F[:L[:N]]]]       prompt lookup of up to K tokens first, Falcon's chain of F otherwise
    tree[:<tree>]                Falcon's tree mode (a preset name or a tune-tree file)
    eagle[:K], ngram[:K]         vLLM's own EAGLE and n-gram proposers
    draft[:K]                    vLLM's draft-model proposer (a small model of the target's family; name it with
                                 @<dir>, default: Qwen2.5-Coder-0.5B-Instruct, converted by `make models-qwen`)
    <cfg>%key=value              one more speculative-config key (JSON value), e.g. falcon%draft_gemm_dtype=model
    <cfg>@<dir>                  another drafter, e.g. chain:2@runs/falcon-2layers
    <cfg>^attr=value             (build_engines) an attribute of the Falcon proposer, set before each generation
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from harness.paths import DEFAULT_EAGLE, ROOT, portable_text

# the environment that changes what is measured, as the caller set it (vLLM's CPU platform later adds its own
# libraries to LD_PRELOAD for the processes it starts): it goes into the results' command
CALLER_ENV = {k: os.environ[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD") if os.environ.get(k)}
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIG_NAMES = ("vanilla, falcon, chain[:K], lookup[:K[:F[:L[:N]]]], tree[:<tree>], eagle[:K], ngram[:K], "
                "draft[:K]")
DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct"  # draft[:K]'s default model


def _spec(cfg: str, drafter: str, num_spec_tokens: int, eagle_drafter: str | None = DEFAULT_EAGLE,
          draft_model: str | None = None):
    kind, _, arg = cfg.partition(":")
    if kind == "vanilla":
        return None
    if kind == "draft":  # vLLM's draft-model proposer
        if draft_model is None:
            from falcon_vllm.models import model_path
            draft_model = str(model_path(DRAFT_MODEL))
        return {"method": "draft_model", "model": draft_model, "num_speculative_tokens": int(arg or num_spec_tokens)}
    if kind == "falcon":  # the drafter's own recommendation (its serving.json)
        return {"method": "falcon", "model": drafter}
    if kind == "ngram":  # vLLM's n-gram proposer
        return {"method": "ngram", "num_speculative_tokens": int(arg or num_spec_tokens),
                "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if kind == "chain":
        return {"method": "falcon", "model": drafter, "num_speculative_tokens": int(arg or num_spec_tokens)}
    if kind == "lookup":  # lookup[:K[:F[:L[:N]]]]: prompt lookup first (n-grams N-4, N=2 by default, up to K
        # tokens; adaptive from L tokens when L < K), Falcon's chain of F otherwise
        K, F, L, N = (arg.split(":") + ["", "", "", ""])[:4]
        K = int(K or 4)
        spec = {"method": "falcon", "model": drafter, "num_speculative_tokens": K, "drafter_tokens": int(F or min(K, 2)),
                "prompt_lookup_min": int(N or 2), "prompt_lookup_max": 4}
        return dict(spec, lookup_tokens=int(L)) if L else spec
    if kind == "eagle":  # vLLM's own EAGLE proposer
        return {"method": "eagle", "model": eagle_drafter, "num_speculative_tokens": int(arg or num_spec_tokens)}
    if kind == "tree":
        tree = arg or "tree-2x2x1"
        if tree.endswith(".json") and not os.path.isabs(tree):
            tree = os.path.join(ROOT, tree)
        return {"method": "falcon", "model": drafter, "tree": tree}
    raise SystemExit(f"falcon-vllm: unknown configuration {cfg!r} ({CONFIG_NAMES})")


def key_values(items: list[str], cfg: str) -> dict:
    """A configuration's ``key=value`` suffixes -> {key: value} (JSON values; anything else stays a string)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"falcon-vllm: option {item!r} in configuration {cfg!r} is not key=value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def spec_for(cfg: str, drafter: str, num_spec_tokens: int, eagle_drafter: str | None = DEFAULT_EAGLE):
    """A configuration name -> its speculative config (None: vanilla).  ``<cfg>%key=value``: more speculative-config
    keys (JSON values); ``<cfg>@<dir>``: another drafter than ``drafter`` / ``eagle_drafter``."""
    cfg, *opts = cfg.split("%")  # falcon%draft_gemm_dtype=model: more speculative-config options
    extra = key_values(opts, cfg)
    cfg, _, other = cfg.partition("@")  # chain:2@<dir>: another drafter than --drafter / --eagle-drafter
    if other:
        drafter = eagle_drafter = other
    spec = _spec(cfg, drafter, num_spec_tokens, eagle_drafter, other or None)
    if extra and spec is None:
        raise SystemExit(f"falcon-vllm: vanilla takes no speculative-config options ({opts})")
    return spec if not extra else {**spec, **extra}


def proposer_attrs(cfg: str) -> tuple[str, dict]:
    """``<cfg>^attr=value``: set an attribute of the Falcon proposer after start-up (implementation switches
    to A/B, e.g. ``falcon^prune_chunk=false``); values as in ``%key=value`` (``key_values``)."""
    cfg, *attrs = cfg.split("^")
    return cfg, key_values(attrs, cfg)


def build_engines(args, model: str, max_num_seqs: int):
    """One engine per configuration (``args.configs``, ``args.compile``, ``args.drafter``, ...), in this process.

    Returns (labels, engines: label -> LLM, switch(label): set that label's proposer attributes, step_count:
    label -> [model steps, seconds in propose_draft_token_ids, requests scheduled over those steps])."""
    from vllm import LLM

    engines = {}  # label -> engine (a configuration given twice, e.g. vanilla,vanilla: the noise floor)
    labels = [c if args.configs.count(c) == 1 else f"{c}#{i}" for i, c in enumerate(args.configs)]
    compiled = set(labels) if args.compile == "all" else {c for c in args.compile.split(",") if c}
    if compiled - set(labels):
        raise SystemExit(f"falcon-vllm: --compile names no configuration: {sorted(compiled - set(labels))} "
                         f"(the labels are {labels})")
    # configurations that differ only in ^attr=value share one engine (one compiled model, the same memory): the
    # attributes are set before each of their generations, so the pair's ratio sees only what the attributes change
    from falcon_vllm.vllm.proposer import falcon_proposer

    shared = {}  # (configuration without ^attrs, compiled, the label of a repeated configuration) -> engine
    switches = {}  # label -> (its engine's Falcon proposer or None, {attr: value})
    # in one process the engine built later can run a few percent slower, whichever configuration it serves:
    # --build-order reversed builds the last configuration first (the baseline stays the first), so a comparison
    # can be run both ways and the order's share read off
    order = list(zip(labels, args.configs))
    if getattr(args, "build_order", "given") == "reversed":
        order.reverse()
    for label, cfg in order:
        base_cfg, attrs = proposer_attrs(cfg)
        key = (base_cfg, label in compiled, label if args.configs.count(cfg) > 1 else "")  # vanilla,vanilla: two
        if key not in shared:
            shared[key] = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=label not in compiled,
                              max_num_seqs=max_num_seqs, seed=0, enable_prefix_caching=False,
                              disable_log_stats=False, speculative_config=spec_for(base_cfg, args.drafter,
                                                                                   args.num_spec_tokens,
                                                                                   args.eagle_drafter))
        engines[label] = shared[key]
        prop = falcon_proposer(engines[label].llm_engine.model_executor.driver_worker.worker.model_runner)
        for attr in attrs:
            if prop is None or not hasattr(prop, attr):
                raise SystemExit(f"falcon-vllm: configuration {label!r}: no Falcon proposer attribute {attr!r}")
        switches[label] = (prop, attrs)
    engines = {label: engines[label] for label in labels}  # the configurations' order, whatever the build order
    defaults = {}  # proposer -> the start-up values of every attribute some label sets
    for prop, attrs in switches.values():
        for attr in attrs:
            defaults.setdefault(id(prop), {}).setdefault(attr, getattr(prop, attr))

    def switch(label):
        prop, attrs = switches[label]
        for attr, value in defaults.get(id(prop), {}).items():
            setattr(prop, attr, attrs.get(attr, value))
    # model steps per generation, counted at the runner (vLLM's spec-decode metrics live in one registry per
    # process, which only the engine built last reports to), the prefill step included: until the batch's
    # slowest request finishes, so max_new_tokens / steps is the tokens per step only at batch 1
    # and the seconds in the runner's propose_draft_token_ids (vLLM's drafter input preparation and the drafter)
    step_count = {}
    # engine -> [steps, drafting seconds, requests scheduled] (labels sharing an engine count their own generations')
    counters = {}
    for cfg, llm in engines.items():
        if id(llm) in counters:
            step_count[cfg] = counters[id(llm)]
            continue
        count = step_count[cfg] = counters[id(llm)] = [0, 0.0, 0]
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        orig, orig_draft = runner.execute_model, runner.propose_draft_token_ids

        def execute_model(scheduler_output, *a, _orig=orig, _count=count, **kw):
            _count[0] += scheduler_output.total_num_scheduled_tokens > 0
            _count[2] += len(scheduler_output.num_scheduled_tokens)
            return _orig(scheduler_output, *a, **kw)

        def propose_draft_token_ids(*a, _orig=orig_draft, _count=count, **kw):
            t = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                _count[1] += time.perf_counter() - t

        runner.execute_model, runner.propose_draft_token_ids = execute_model, propose_draft_token_ids
    return labels, engines, switch, step_count


def compile_words(compile_arg: str) -> str:
    """``--compile``'s value in words, for the result page."""
    if compile_arg == "all":
        return "torch.compile (vLLM default)"
    return f"torch.compile for {compile_arg}, the others eager" if compile_arg else "eager"


def command_line(script: str) -> str:
    """This run's command as the results record it: the caller's measured environment, repository-relative paths."""
    env = "".join(f"{k}={shlex.quote(portable_text(v))} " for k, v in CALLER_ENV.items())
    return env + f"python benchmarks/{script} " + " ".join(shlex.quote(portable_text(a)) for a in sys.argv[1:])
