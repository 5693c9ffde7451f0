"""Resolve a ``{"method": "falcon", ...}`` speculative config: its drafter, its drafter's ``serving.json``, its mode.

The keys, their bounds and the rules between them are :mod:`falcon_vllm.schema`'s.

Drafter resolution (``model`` missing, ``"falcon"``, or ``--speculative-model falcon``):
1. an explicit directory given as ``model``;
2. a drafter shipped in ``falcon_vllm/drafters/`` whose recorded target matches the served
   model (hidden size, vocabulary, number of layers, model type);
3. the directory in ``$FALCON_VLLM_DRAFTER``;
otherwise one error lists what was tried.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from falcon_vllm.config import FalconConfig
from falcon_vllm.datastore import Datastore
from falcon_vllm.drafter import FalconDrafter, check_state_dict, load_state_dict_file
from falcon_vllm.serving import Lookup, Serving
from falcon_vllm.schema import (GEMM_DTYPES, INCOMPATIBLE, LOOKUP_KEYS, MAX_TREE_NODES, STORE_KEYS, check_chain_length,
                                FalconOptions, parse, read_serving, read_tree_file)
from falcon_vllm.tree import build_tree

GEMM_DTYPE_ENV = "FALCON_VLLM_DRAFT_GEMM_DTYPE"  # draft_gemm_dtype's default


def check_gemm_dtype(choice, source: str = "draft_gemm_dtype") -> None:
    if choice not in GEMM_DTYPES:
        raise ValueError(f"falcon-vllm: {source} must be one of {list(GEMM_DTYPES)}, got {choice!r}")


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


def check_weights(path: str, cfg: FalconConfig | None = None) -> None:
    """The drafter's weights readable and, given its ``cfg``, each tensor's name and shape what the config builds
    (from the safetensors header, the small ``d2t`` map read whole): a checkpoint that does not match its
    config.json is refused here, with the tensors that differ, not in vLLM's worker."""
    st, pt = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.exists(st):
        from safetensors import safe_open
        try:
            with safe_open(st, "pt") as f:
                state = {k: (f.get_tensor(k) if k == "d2t" else torch.empty(f.get_slice(k).get_shape(),
                                                                              device="meta")) for k in f.keys()}
        except Exception as e:
            raise ValueError(f"falcon-vllm: drafter weights {st} are corrupt or truncated ({e})") from None
    elif os.path.exists(pt):
        state = load_state_dict_file(path) if cfg is not None else {}  # its clear error when unreadable
    else:
        raise ValueError(f"falcon-vllm: drafter directory {path!r} has no weights (model.safetensors)")
    if cfg is not None:
        with torch.device("meta"):
            model = FalconDrafter(cfg)
        check_state_dict(model, state, path)


SERVING_FILE = "serving.json"


def with_recommendation(opts: FalconOptions, drafter: str) -> FalconOptions:
    """``opts`` (a config that gives neither ``tree`` nor ``num_speculative_tokens``) completed by the drafter's
    ``serving.json``, if it has one (:func:`falcon_vllm.schema.read_serving`): a tune-tree file becomes the tree;
    the chain form gives its keys one by one where the config gives none, its schedule for this CPU where it has
    one (:func:`cpu_capability`), its draft_temperature_scale only with sampled drafts, and its lookup and
    datastore keys only when the config gives none of the lookup keys (its datastore, relative to the drafter's
    directory, only when the config gives no datastore)."""
    f = os.path.join(drafter, SERVING_FILE)
    if not os.path.isfile(f):
        return opts
    served = read_serving(f)
    if served.tree_file is not None:
        return replace(opts, tree=served.tree_file)
    rec = served.for_cpu(cpu_capability())
    unset = lambda keys: [k for k in keys if getattr(opts, k) is None]  # noqa: E731
    take = {k: getattr(rec, k) for k in unset(("num_speculative_tokens", "num_speculative_tokens_per_batch_size",
                                               "draft_sample_method"))}
    if (take.get("draft_sample_method") or opts.draft_sample_method) == "probabilistic":
        take |= {k: rec.draft_temperature_scale for k in unset(("draft_temperature_scale",))}
    if not [k for k in LOOKUP_KEYS if getattr(opts, k) is not None]:
        take |= {k: getattr(rec, k) for k in unset(LOOKUP_KEYS + ("drafter_max_batch",))}
        if isinstance(rec.datastore, str) and opts.datastore is None:
            take |= {k: getattr(rec, k) for k in unset(STORE_KEYS[1:])}
            take["datastore"] = os.path.join(drafter, rec.datastore)
    return replace(opts, **{k: v for k, v in take.items() if v is not None})


def cpu_capability() -> str | None:
    """The CPU's vector capability as torch names it ("AVX512", "AVX2", ...) when vLLM serves on the CPU, else None:
    how many rows a CPU verifies at the price of one depends on it, so a drafter's serving.json may give each its
    own per-batch-size schedule."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _batch_size_trees(tree_file, tree_spec, k: int, n: int):
    """A ``falcon-vllm tune-tree`` file's per-batch-size trees (``tree_file``, read from ``tree_spec``) -> (vLLM's
    dynamic K schedule, {nodes: paths}); None for any other tree spec.  Batch sizes between two fitted ones take the
    smaller one's tree; beyond the largest, its tree (0 nodes = no speculation)."""
    rows = tree_file.by_batch_size if tree_file is not None else None
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


def check_async_scheduling(serving: Serving, async_scheduling: bool | None, runner_v2: bool = False) -> bool | None:
    """The ``async_scheduling`` the engine should run with: False where the config gives ragged drafts (on Model
    Runner V2, tree mode too: a batch it cannot verify exactly drafts nothing) and the user left it to vLLM (None,
    which would turn it on for EAGLE's plumbing on a GPU), an error where the user asked for it; otherwise as
    given."""
    ragged = serving.ragged or ("tree mode on Model Runner V2" if runner_v2 and serving.mode == "tree" else None)
    if ragged is None:
        return async_scheduling
    if async_scheduling:
        raise ValueError(f"falcon-vllm: {ragged} gives requests drafts of different lengths, which vLLM's async "
                         "scheduler cannot take: run with --no-async-scheduling (or without async_scheduling=True)")
    return False


def check_cudagraph_mode(serving: Serving, mode, enforce_eager: bool = False):
    """The ``cudagraph_mode`` the engine should run with.  Tree mode computes the target's attention in Python
    (the ancestor mask), which only piecewise CUDA graphs leave outside the captured graphs: left to vLLM
    (None, which becomes FULL_AND_PIECEWISE on CUDA), PIECEWISE; a full mode asked for, an error (unless
    ``enforce_eager``, under which vLLM captures no graphs).  Chains run vLLM's own attention: as given."""
    from vllm.config import CUDAGraphMode

    if serving.mode != "tree" or enforce_eager:
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


def check_tree_for_drafter(spec, tree, cfg: FalconConfig, fitted: int | None) -> None:
    """A tree the drafter can draft: its ranks within the drafter's vocabulary, and a tune-tree file fitted (``fitted``:
    the k it records) for the drafter's block size."""
    vocab = cfg.draft_vocab_size or cfg.vocab_size
    if tree.topk > vocab:
        raise ValueError(f"falcon-vllm: tree {spec!r} asks for the drafter's rank {tree.topk - 1} token, but the "
                         f"drafter drafts from {vocab} tokens")
    if fitted is not None and fitted != cfg.k:
        raise ValueError(f"falcon-vllm: tree file {spec} was fitted for a drafter of k={fitted}; this drafter has "
                         f"k={cfg.k}: fit its trees with `falcon-vllm tune-tree`")


def resolve_falcon_config(sc: dict, target_hf, valid_keys: set[str]) -> tuple[dict, Serving]:
    """Return (the config to give vLLM with method 'eagle', the drafter's :class:`~falcon_vllm.serving.Serving`,
    whose ``section()`` tags the draft config).  A config that
    gives neither a tree nor ``num_speculative_tokens`` takes the drafter's ``serving.json``."""
    opts, rest, names = parse(sc, valid_keys)
    for key, allowed, why in INCOMPATIBLE:
        if rest.get(key) not in allowed:
            raise ValueError(f"falcon-vllm: {key}={rest[key]!r} is not supported ({why})")
    path = resolve_drafter(opts.model, target_hf)
    cfg = FalconConfig.load(path)  # clear errors: missing dir, no config.json, not a Falcon drafter
    cfg.check_target(target_hf)    # clear error: drafter for another hidden size / vocabulary
    if cfg.aux_layers:
        raise ValueError(f"falcon-vllm: the drafter at {path} reads the states entering target layers "
                         f"{list(cfg.aux_layers)} (trained with --aux-layers); the vLLM proposer passes it the final "
                         "hidden states only, so it cannot serve this drafter. Use one trained without --aux-layers")
    check_weights(path, cfg)
    if opts.drafter_k is not None and opts.drafter_k != cfg.k:
        raise ValueError(f"falcon-vllm: {names['drafter_k']}={opts.drafter_k!r} but the drafter at {path} was trained "
                         f"with k={cfg.k}")
    if opts.tree is None and opts.num_speculative_tokens is None:
        opts = with_recommendation(opts, path)
    tree, n = None, opts.num_speculative_tokens
    tree_file = read_tree_file(opts.tree) if isinstance(opts.tree, str) and os.path.isfile(opts.tree) else None
    if opts.tree is not None:
        tree = build_tree(opts.tree, cfg.k)
        if n is not None and n != tree.num_nodes:
            raise ValueError(f"falcon-vllm: num_speculative_tokens={n} disagrees with tree {opts.tree!r} "
                             f"({tree.num_nodes} nodes); give one of them")
        if tree.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"falcon-vllm: tree {opts.tree!r} has {tree.num_nodes} nodes; tree mode verifies at most "
                             f"{MAX_TREE_NODES} per request and step. Use a smaller tree (e.g. 'falcon-llama', 118 "
                             "nodes) or fit one with `falcon-vllm tune-tree`")
        n = tree.num_nodes
        check_tree_for_drafter(opts.tree, tree, cfg, tree_file.k if tree_file else None)
    n = 2 * cfg.k if n is None else n
    if tree is None or tree.is_chain:
        check_chain_length(n)
    sized = _batch_size_trees(tree_file, opts.tree, cfg.k, n) if tree is not None else None
    tree_mode = tree is not None and bool(sized or not tree.is_chain)  # a tune-tree file runs in tree mode
    lookup = opts.check(n, tree_mode, names)
    if tree_mode and rest.get("rejection_sample_method") not in (None, "standard"):
        raise ValueError(f"falcon-vllm: rejection_sample_method={rest['rejection_sample_method']!r} is vLLM's chain "
                         "sampler's; tree mode verifies with its own tree sampler. Give a chain or drop it")
    store = None if opts.datastore is False else opts.datastore
    if store is not None:
        ds = Datastore.load(store)  # clear errors: missing or unreadable file
        if ds.max_token() >= target_hf.vocab_size:
            raise ValueError(f"falcon-vllm: datastore {store!r} holds token id {ds.max_token()}, outside the target's "
                             f"vocabulary of {target_hf.vocab_size}: it was built for another target")
    eagle = dict(rest, method="eagle", model=path, num_speculative_tokens=n)
    for key in ("num_speculative_tokens_per_batch_size", "draft_sample_method"):
        if getattr(opts, key) is not None:
            eagle[key] = getattr(opts, key)
    serving = Serving(k=cfg.k, block_order=cfg.block_order, level_embedding=bool(cfg.level_embedding),
                      num_speculative_tokens=n, draft_gemm_dtype=opts.draft_gemm_dtype or None,
                      draft_confidence=float(opts.draft_confidence or 0.0),
                      draft_temperature_scale=float(opts.draft_temperature_scale or 1.0))
    if tree_mode:
        subtrees = None
        if sized:
            schedule, subtrees = sized
            eagle.setdefault("num_speculative_tokens_per_batch_size", schedule)
        return eagle, replace(serving, mode="tree", tree=tree.to_list(), tree_name=tree.name or "custom",
                              subtrees=subtrees)
    if lookup is not None:
        serving = replace(serving, lookup=Lookup(
            prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1], drafter_tokens=opts.drafter_tokens or n,
            lookup_tokens=opts.lookup_tokens or n, drafter_max_batch=opts.drafter_max_batch,
            **({"datastore": os.path.abspath(store), **{key: getattr(opts, key) for key in STORE_KEYS[1:]}}
               if store is not None else {})))
    return eagle, serving
