"""Validate a ``{"method": "falcon", ...}`` speculative config and resolve its drafter.

Drafter resolution (``model`` missing, ``"falcon"``, or ``--speculative-model falcon``):
1. an explicit directory given as ``model``;
2. a drafter shipped in ``falcon_vllm/drafters/`` whose recorded target matches the served
   model (hidden size, vocabulary, number of layers, model type);
3. the directory in ``$FALCON_VLLM_DRAFTER``;
otherwise one error lists what was tried.
"""

from __future__ import annotations

import os
from pathlib import Path

from falcon_vllm.config import FalconConfig
from falcon_vllm.datastore import Datastore
from falcon_vllm.tree import build_tree
from falcon_vllm.schema import LOOKUP_BATCH_KEY, LOOKUP_KEYS, STORE_KEYS, read_tree_file

GEMM_DTYPES = ("auto", "bfloat16", "int8", "model")  # draft_gemm_dtype values: falcon_vllm.vllm.model.gemm_dtype
GEMM_DTYPE_ENV = "FALCON_VLLM_DRAFT_GEMM_DTYPE"  # its default


def check_gemm_dtype(choice, source: str = "draft_gemm_dtype") -> None:
    if choice not in GEMM_DTYPES:
        raise ValueError(f"falcon-vllm: {source} must be one of {list(GEMM_DTYPES)}, got {choice!r}")


# Falcon-only options, removed before vLLM validates the rest:
#   tree      a preset name ("falcon-llama", "chain-6", "tree-4x2x1"), a list of rank paths or a JSON
#             file (e.g. from `falcon-vllm tune-tree`); sets K = number of nodes.  A chain runs in
#             chain mode (vLLM's rejection sampler), any other tree in tree mode.
#   falcon_k  the block size the drafter must have been trained with (a consistency check)
#   falcon_tokens  with prompt lookup: the drafter's chain length where lookup finds nothing (default K)
#   lookup_tokens  with prompt lookup: a request's lookup draft length after a rejection; it doubles after a
#             fully accepted lookup draft, up to K (default K: every lookup draft up to K tokens)
#   datastore  with prompt lookup: a `falcon-vllm datastore` file of the target's answers, looked up where a
#             request's own tokens repeat nothing (in a drafter's serving.json: relative to its directory); false: off
#   datastore_tokens  with a datastore: its drafts' longest length (default: a lookup draft's)
#   datastore_max_batch  with a datastore: it is looked up only in steps of at most this many requests (default:
#             every step); its drafts are long, and the rows they add cost more as the batch grows
#   falcon_max_batch  with prompt lookup: the drafter's chain serves only steps of at most this many requests; a
#             larger step gets lookup drafts alone (where the batch-size schedule still drafts there), its verified
#             rows kept for the next drafter pass as in a step with drafting off (default: every step)
#   draft_confidence  chain mode: a request's chain draft stops before its first token where the product of the
#             drafter's probabilities of its tokens so far falls below this (0 <= value < 1; default 0: every token),
#             and a further drafter pass runs only while some request's draft is still going; rows unlikely to be
#             accepted are not verified (each verified row costs target arithmetic on a CPU)
#   draft_gemm_dtype  "auto", "bfloat16", "int8" or "model": the dtype of the drafter's matmuls (default: the
#             environment's FALCON_VLLM_DRAFT_GEMM_DTYPE, else auto).  int8 (CPU): int8 weights and per-row
#             quantized inputs (a quarter of fp32's weight bytes).  auto, serving an fp32 model on a CPU:
#             bfloat16 with bf16 matmul units (half the bytes), else int8 with VNNI; the model's dtype elsewhere.
#             Drafts may change slightly, outputs never do.
# vLLM's prompt_lookup_min / prompt_lookup_max (ngram's options) turn on prompt lookup first, Falcon
# otherwise (chain mode, :mod:`falcon_vllm.vllm.lookup`); prompt_lookup_max 0 turns it off.
FALCON_KEYS = {"tree", "falcon_k", "falcon_tokens", "lookup_tokens", "datastore", "datastore_tokens",
               "datastore_max_batch", "falcon_max_batch", "draft_gemm_dtype", "draft_temperature_scale",
               "draft_confidence"}
# vLLM options that contradict how Falcon drafts: (key, allowed values, why)
INCOMPATIBLE = (
    ("parallel_drafting", (False, None), "Falcon drafts k tokens per pass semi-autoregressively"),
    ("use_heterogeneous_vocab", (False, None), "the drafter shares the target's vocabulary"),
)
# chain mode verifies with vLLM's rejection sampler, which caps a step at 128 speculative tokens;
# tree mode has its own sampler and verifies trees up to MAX_TREE_NODES nodes per request
MAX_CHAIN_TOKENS = 128
MAX_TREE_NODES = 512
DRAFTERS_DIR = Path(__file__).resolve().parent.parent / "drafters"


def shipped_drafters() -> list[Path]:
    if not DRAFTERS_DIR.is_dir():
        return []
    return sorted(p for p in DRAFTERS_DIR.iterdir() if (p / "config.json").exists())


def resolve_drafter(model, target_hf) -> str:
    if model not in (None, "falcon"):
        return str(model)
    tried = []
    for d in shipped_drafters():
        try:
            cfg = FalconConfig.load(str(d))
        except (ValueError, FileNotFoundError):
            continue  # e.g. an EAGLE export in the same folder
        problems = cfg.target_problems(target_hf, recorded=True)
        if not problems:
            return str(d)
        tried.append(f"{d.name} ({', '.join(problems)})")
    env = os.environ.get("FALCON_VLLM_DRAFTER")
    if env:
        return env
    raise ValueError(
        "falcon-vllm: no drafter for this target. Tried: (1) an explicit path ('model' / --speculative-model "
        f"<dir>): none given; (2) drafters shipped in {DRAFTERS_DIR}, none trained for this target: "
        f"{'; '.join(tried) or 'none'}; (3) $FALCON_VLLM_DRAFTER: not set. Pass a drafter directory, "
        "or train one with `falcon-vllm train`.")


def check_weights(path: str) -> None:
    st, pt = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.exists(st):
        from safetensors import safe_open
        try:
            with safe_open(st, "pt") as f:
                f.keys()
        except Exception as e:
            raise ValueError(f"falcon-vllm: drafter weights {st} are corrupt or truncated ({e})") from None
    elif not os.path.exists(pt):
        raise ValueError(f"falcon-vllm: drafter directory {path!r} has no weights (model.safetensors)")


SERVING_FILE = "serving.json"


def recommended_serving(path: str) -> tuple[str | None, int | None, dict, dict]:
    """(tree spec, num_speculative_tokens, other speculative-config keys, prompt-lookup options) a drafter directory
    recommends in ``serving.json``: either a ``falcon-vllm tune-tree`` file (its tree and per-batch-size schedule
    are used) or ``{"num_speculative_tokens": n}`` (a chain), optionally with vLLM's
    ``num_speculative_tokens_per_batch_size`` (``[[lo, hi, K], ...]``: the chain's length per batch-size range,
    0 = drafting off; ``num_speculative_tokens_per_batch_size_by_cpu``: such a schedule per CPU capability, used
    instead on a CPU of that capability, :func:`cpu_capability`) and ``draft_sample_method``
    (``"probabilistic"``: sampled requests get drafts drawn at their temperature times
    ``draft_temperature_scale``), and the prompt-lookup options (``prompt_lookup_min`` /
    ``prompt_lookup_max`` / ``falcon_tokens``); None / {} when it has none."""
    f = os.path.join(path, SERVING_FILE)
    if not os.path.isfile(f):
        return None, None, {}, {}
    rec = read_tree_file(f)
    if rec.tuned:
        if rec.draft_sample_method not in (None, "greedy"):
            raise ValueError(f"falcon-vllm: {f}: draft_sample_method={rec.draft_sample_method!r} needs a chain; "
                             "a tune-tree file serves a tree, whose nodes are drafted greedily")
        return f, None, {}, {}
    n, sched, method = rec.num_speculative_tokens, rec.chain_schedule, rec.draft_sample_method
    if n is not None:
        by_cpu = rec.chain_schedule_by_cpu
        if by_cpu is not None and not (isinstance(by_cpu, dict) and all(isinstance(c, str) for c in by_cpu)):
            raise ValueError(f"falcon-vllm: {f}: num_speculative_tokens_per_batch_size_by_cpu must map CPU "
                             f"capabilities (e.g. \"AVX512\", as torch.backends.cpu.get_cpu_capability() names "
                             f"them) to schedules, got {by_cpu!r}")
        for key, sch in [("num_speculative_tokens_per_batch_size", sched)] + [
                (f"num_speculative_tokens_per_batch_size_by_cpu[{c!r}]", v) for c, v in (by_cpu or {}).items()]:
            if sch is not None and not (isinstance(sch, list) and all(
                    isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) and x >= 0 for x in r)
                    and r[0] <= r[1] and r[2] <= n for r in sch)):
                raise ValueError(f"falcon-vllm: {f}: {key} must be a list of [min batch size, max batch size, K] "
                                 f"with 0 <= K <= num_speculative_tokens ({n}), got {sch!r}")
        sched = (by_cpu or {}).get(cpu_capability(), sched)  # a schedule measured on this kind of CPU wins
        if method not in (None, "greedy", "probabilistic"):
            raise ValueError(f"falcon-vllm: {f}: draft_sample_method must be \"greedy\" or \"probabilistic\", "
                             f"got {method!r}")
        if rec.draft_temperature_scale is not None and method != "probabilistic":
            raise ValueError(f"falcon-vllm: {f}: draft_temperature_scale applies to sampled drafts "
                             "(draft_sample_method \"probabilistic\")")
        keys = {"num_speculative_tokens_per_batch_size": sched, "draft_sample_method": method,
                "draft_temperature_scale": rec.draft_temperature_scale}
        return None, n, {key: v for key, v in keys.items() if v is not None}, rec.lookup
    raise ValueError(f"falcon-vllm: {f} must be a `falcon-vllm tune-tree` file or {{\"num_speculative_tokens\": n}}")


def cpu_capability() -> str | None:
    """The CPU's vector capability as torch names it ("AVX512", "AVX2", ...) when vLLM serves on the CPU, else None:
    how many rows a CPU verifies at the price of one depends on it, so a drafter's serving.json may give each its
    own per-batch-size schedule."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _batch_size_trees(tree_spec, k: int, n: int):
    """A ``falcon-vllm tune-tree`` file's per-batch-size trees -> (vLLM's dynamic K schedule,
    {nodes: paths}); None for any other tree spec.  Batch sizes between two fitted ones take the
    smaller one's tree; beyond the largest, its tree (0 nodes = no speculation)."""
    if not (isinstance(tree_spec, str) and os.path.isfile(tree_spec)):
        return None
    rows = read_tree_file(tree_spec).by_batch_size
    if not rows:
        return None
    schedule, sized = [], {}
    for i, (b, paths) in enumerate(rows):
        w = len(paths)
        if w > n:
            raise ValueError(f"falcon-vllm: tree file {tree_spec}: the tree for batch size {b} has {w} nodes, more "
                             f"than the file's main tree ({n})")
        if w:
            sized[w] = build_tree(paths, k).to_list()
        hi = rows[i + 1][0] - 1 if i + 1 < len(rows) else 1 << 20
        schedule.append([1 if i == 0 else b, hi, w])
    return schedule, sized


def ragged_drafts(falcon: dict) -> str | None:
    """What in a resolved Falcon config (the ``info`` of :func:`resolve_falcon_config`) gives requests drafts of
    different lengths in one step, which vLLM's async scheduler cannot take; None when nothing does."""
    ragged = [name for name, on in (("prompt lookup (prompt_lookup_max)", falcon.get("prompt_lookup")),
                                    ("draft_confidence", falcon.get("draft_confidence"))) if on]
    return " and ".join(ragged) or None


def check_async_scheduling(falcon: dict, async_scheduling: bool | None) -> bool | None:
    """The ``async_scheduling`` the engine should run with: False where the config gives ragged drafts and the
    user left it to vLLM (None, which would turn it on for EAGLE's plumbing on a GPU), an error where the user
    asked for it; otherwise as given."""
    ragged = ragged_drafts(falcon)
    if ragged is None:
        return async_scheduling
    if async_scheduling:
        raise ValueError(f"falcon-vllm: {ragged} gives requests drafts of different lengths, which vLLM's async "
                         "scheduler cannot take: run with --no-async-scheduling (or without async_scheduling=True)")
    return False


def check_cudagraph_mode(falcon: dict, mode, enforce_eager: bool = False):
    """The ``cudagraph_mode`` the engine should run with.  Tree mode computes the target's attention in Python
    (the ancestor mask), which only piecewise CUDA graphs leave outside the captured graphs: left to vLLM
    (None, which becomes FULL_AND_PIECEWISE on CUDA), PIECEWISE; a full mode asked for, an error (unless
    ``enforce_eager``, under which vLLM captures no graphs).  Chains run vLLM's own attention: as given."""
    from vllm.config import CUDAGraphMode

    if falcon.get("mode") != "tree" or enforce_eager:
        return mode
    if mode is None:
        return CUDAGraphMode.PIECEWISE
    if isinstance(mode, str):
        mode = CUDAGraphMode[mode.upper()]
    if mode.has_full_cudagraphs():
        raise ValueError("falcon-vllm: tree mode needs the target's attention outside CUDA graphs (a fully captured "
                         "graph would replay the stock attention and skip the ancestor mask): leave cudagraph_mode "
                         "unset, or run with --compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' or "
                         f"--enforce-eager (cudagraph_mode is {mode.name})")
    return mode


def resolve_falcon_config(sc: dict, target_hf, valid_keys: set[str]) -> tuple[dict, dict]:
    """Return (the config to give vLLM with method 'eagle', Falcon info to tag the draft config)."""
    sc = {k.replace("-", "_"): v for k, v in sc.items()}
    unknown = sorted(set(sc) - valid_keys - FALCON_KEYS)
    if unknown:
        raise ValueError(f"falcon-vllm: unknown option(s) {unknown} in the speculative config; Falcon options: "
                         f"{sorted(FALCON_KEYS)}, plus vLLM's: {sorted(valid_keys)}")
    for key, allowed, why in INCOMPATIBLE:
        if sc.get(key) not in allowed:
            raise ValueError(f"falcon-vllm: {key}={sc[key]!r} is not supported ({why})")
    path = resolve_drafter(sc.get("model"), target_hf)
    cfg = FalconConfig.load(path)  # clear errors: missing dir, no config.json, not a Falcon drafter
    cfg.check_target(target_hf)    # clear error: drafter for another hidden size / vocabulary
    if cfg.aux_layers:
        raise ValueError(f"falcon-vllm: the drafter at {path} reads the states entering target layers "
                         f"{list(cfg.aux_layers)} (trained with --aux-layers); the vLLM proposer passes it the final "
                         "hidden states only, so it cannot serve this drafter. Use one trained without --aux-layers")
    check_weights(path)
    want_k = sc.pop("falcon_k", None)
    if want_k is not None and want_k != cfg.k:
        raise ValueError(f"falcon-vllm: falcon_k={want_k!r} but the drafter at {path} was trained with k={cfg.k}")
    gemm = sc.pop("draft_gemm_dtype", None)
    if gemm is not None:
        check_gemm_dtype(gemm)
    tree_spec = sc.pop("tree", None)
    n = sc.get("num_speculative_tokens")
    if tree_spec is None and n is None:  # the drafter's recommended configuration, if it ships one
        tree_spec, n, rec_keys, lookup_rec = recommended_serving(path)
        rec_scale = rec_keys.pop("draft_temperature_scale", None)  # only with the sampled drafts it scales
        for key, v in rec_keys.items():  # explicit keys win
            if sc.get(key) is None:
                sc[key] = v
        if rec_scale is not None and sc.get("draft_sample_method") == "probabilistic":
            sc.setdefault("draft_temperature_scale", rec_scale)
        rec_store = {key: lookup_rec.pop(key) for key in STORE_KEYS if key in lookup_rec}
        if not any(key in sc for key in LOOKUP_KEYS):
            sc.update({key: v for key, v in lookup_rec.items() if sc.get(key) is None})  # explicit keys win
            if isinstance(rec_store.get("datastore"), str) and "datastore" not in sc:  # relative to the drafter
                sc["datastore"] = os.path.join(path, rec_store["datastore"])
                for key in STORE_KEYS[1:]:
                    sc.setdefault(key, rec_store.get(key))
    store = sc.pop("datastore", None)
    store = None if store is False else store  # false: off (e.g. over a drafter's recommended configuration)
    store_opts = {key: sc.pop(key, None) for key in STORE_KEYS[1:]}  # datastore_tokens, datastore_max_batch
    for key, v in store_opts.items():
        if v is not None and (store is None or not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"falcon-vllm: {key} must be an integer >= 1 and comes with a datastore, got "
                             f"{v!r}" + ("" if store is not None else " without one"))
    lookup = _lookup_options(sc)  # pops the prompt-lookup keys
    falcon_max_batch = sc.pop(LOOKUP_BATCH_KEY, None)
    if falcon_max_batch is not None and (lookup is None or not isinstance(falcon_max_batch, int)
                                         or isinstance(falcon_max_batch, bool) or falcon_max_batch < 0):
        raise ValueError(f"falcon-vllm: {LOOKUP_BATCH_KEY} must be an integer >= 0 and comes with prompt lookup "
                         f"(prompt_lookup_max), got {falcon_max_batch!r}" + ("" if lookup else " without it"))
    if store is not None:
        if not isinstance(store, str) or lookup is None:
            raise ValueError("falcon-vllm: datastore (a `falcon-vllm datastore` file, or false) is looked up with "
                             "prompt lookup: give prompt_lookup_max too, and the file's path as a string "
                             f"(got {store!r})")
        ds = Datastore.load(store)  # clear errors: missing or unreadable file
        if ds.max_token() >= target_hf.vocab_size:
            raise ValueError(f"falcon-vllm: datastore {store!r} holds token id {ds.max_token()}, outside the target's "
                             f"vocabulary of {target_hf.vocab_size}: it was built for another target")
    scale = sc.pop("draft_temperature_scale", None)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 16:
            raise ValueError(f"falcon-vllm: draft_temperature_scale must be a number in (0, 16], got {scale!r}")
        if sc.get("draft_sample_method") != "probabilistic":
            raise ValueError("falcon-vllm: draft_temperature_scale (the drafter's temperature over the request's) "
                             "applies to sampled drafts: give draft_sample_method \"probabilistic\" too")
    confidence = sc.pop("draft_confidence", None)
    if confidence is not None and (isinstance(confidence, bool) or not isinstance(confidence, (int, float))
                                   or not 0 <= confidence < 1):
        raise ValueError(f"falcon-vllm: draft_confidence must be a number in [0, 1), got {confidence!r}")
    tree = None
    if tree_spec is not None:
        tree = build_tree(tree_spec, cfg.k)
        if n is not None and n != tree.num_nodes:
            raise ValueError(f"falcon-vllm: num_speculative_tokens={n} disagrees with tree {tree_spec!r} "
                             f"({tree.num_nodes} nodes); give one of them")
        if tree.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"falcon-vllm: tree {tree_spec!r} has {tree.num_nodes} nodes; tree mode verifies at most "
                             f"{MAX_TREE_NODES} per request and step. Use a smaller tree (e.g. 'falcon-llama', 118 "
                             "nodes) or fit one with `falcon-vllm tune-tree`")
        n = tree.num_nodes
    if n is None:
        n = 2 * cfg.k
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"falcon-vllm: num_speculative_tokens must be an integer >= 1, got {n!r}")
    if (tree is None or tree.is_chain) and n > MAX_CHAIN_TOKENS:
        raise ValueError(f"falcon-vllm: a chain of {n} speculative tokens is above the {MAX_CHAIN_TOKENS} that vLLM's "
                         "rejection sampler verifies per step; use a shorter chain or a tree")
    sized = _batch_size_trees(tree_spec, cfg.k, n) if tree is not None else None
    tree_mode = tree is not None and bool(sized or not tree.is_chain)  # a tune-tree file runs in tree mode
    if lookup is not None and tree_mode:
        raise ValueError("falcon-vllm: prompt lookup (prompt_lookup_max) runs in chain mode; give a chain "
                         "(num_speculative_tokens) instead of a tree, or drop prompt_lookup_max")
    if tree_mode and sc.get("draft_sample_method") not in (None, "greedy"):
        raise ValueError(f"falcon-vllm: draft_sample_method={sc['draft_sample_method']!r} runs in chain mode (vLLM's "
                         "rejection sampler reads the drafts' probabilities); tree mode drafts each node greedily. "
                         "Give a chain (num_speculative_tokens) or drop draft_sample_method")
    if tree_mode and confidence:
        raise ValueError("falcon-vllm: draft_confidence cuts chain drafts; tree mode verifies its whole tree. Give a "
                         "chain (num_speculative_tokens) or drop draft_confidence")
    info = {} if gemm is None else {"draft_gemm_dtype": gemm}
    if confidence:
        info["draft_confidence"] = float(confidence)
    if scale is not None:
        info["draft_temperature_scale"] = float(scale)
    if tree_mode:
        sc.update(method="eagle", model=path, num_speculative_tokens=n)
        info |= {"mode": "tree", "num_speculative_tokens": n, "tree": tree.to_list(), "tree_name": tree.name or "custom"}
        if sized:
            schedule, info["subtrees"] = sized
            if sc.get("num_speculative_tokens_per_batch_size") is None:
                sc["num_speculative_tokens_per_batch_size"] = schedule
        return sc, info
    sc.update(method="eagle", model=path, num_speculative_tokens=n)
    info |= {"mode": "chain", "num_speculative_tokens": n}
    if lookup is not None:
        lo, hi, falcon_tokens, lookup_tokens = lookup
        falcon_tokens = n if falcon_tokens is None else falcon_tokens
        lookup_tokens = n if lookup_tokens is None else lookup_tokens
        for key, v in (("falcon_tokens", falcon_tokens), ("lookup_tokens", lookup_tokens)):
            if v > n:
                raise ValueError(f"falcon-vllm: {key}={v} is above num_speculative_tokens={n}")
        info.update(prompt_lookup=[lo, hi], falcon_tokens=falcon_tokens, lookup_tokens=lookup_tokens)
        if falcon_max_batch is not None:
            info[LOOKUP_BATCH_KEY] = falcon_max_batch
        if store is not None:
            info["datastore"] = os.path.abspath(store)
            info.update({key: v for key, v in store_opts.items() if v is not None})
    return sc, info


def _lookup_options(sc: dict) -> tuple[int, int, int | None, int | None] | None:
    """Pop ``prompt_lookup_min`` / ``prompt_lookup_max`` / ``falcon_tokens`` / ``lookup_tokens`` from ``sc`` ->
    (min, max, falcon_tokens, lookup_tokens) or None (lookup off).  As for vLLM's ngram, a missing bound takes
    the other's value."""
    lo, hi, ft, lt = (sc.pop(key, None) for key in LOOKUP_KEYS)
    for key, v in zip(LOOKUP_KEYS, (lo, hi, ft, lt)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"falcon-vllm: {key} must be an integer >= 1, got {v!r}")
    given = [key for key, v in zip(LOOKUP_KEYS[2:], (ft, lt)) if v is not None]
    if hi == 0:  # explicitly off (e.g. over a drafter's recommended configuration)
        if given:
            raise ValueError(f"falcon-vllm: {given[0]} only applies with prompt lookup (prompt_lookup_max >= 1)")
        return None
    if lo is None and hi is None:
        if given:
            raise ValueError(f"falcon-vllm: {given[0]} only applies with prompt lookup: give prompt_lookup_max "
                             "(the longest n-gram looked up), or use num_speculative_tokens for the drafter's chain")
        return None
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    if lo < 1 or lo > hi:
        raise ValueError(f"falcon-vllm: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
    for key, v in zip(LOOKUP_KEYS[2:], (ft, lt)):
        if v is not None and v < 1:
            raise ValueError(f"falcon-vllm: {key} must be an integer >= 1, got {v!r}")
    return lo, hi, ft, lt
