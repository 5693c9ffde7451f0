"""Fit a decoding tree to a drafter and a machine (``falcon-vllm tune-tree``).

The paper hand-designed its trees.  We fit them from two measurements:

1. **Rank profile** (what the drafter gets right): at many root positions of sequences the target
   generated greedily, the rank of each true token in its drafter row along the true path, drafted
   exactly as in serving (:mod:`falcon_vllm.acceptance`).  The W nodes most often on those paths make
   the best tree of W nodes (prefix counts never increase along a path, so the set is a valid tree),
   with ``tau(tree) = 1 + sum over nodes of P(node)`` tokens per step.
2. **Cost of verifying W tokens** at batch size B on the target (one step of B x (1 + W) tree
   tokens over a prefix) plus the drafter passes.  By default it is measured inside vLLM, on the engine that
   serves the target (:mod:`falcon_vllm.vllm.verify_cost`): rows cost very differently there than in
   transformers.  ``--cost transformers`` times a transformers forward instead, where vLLM is not installed.

For each batch size the tree size W maximising ``tau(W) / step_time(B, W)`` is chosen (W = 0, no
speculation, is a candidate), so a large batch gets a small tree and never runs slower than plain
decoding under the measured cost model.  A tree whose modelled gain stays below ``--min-gain`` is not
drafted: the model times prefill-shaped steps, a few percent off a served step (docs/training.md, "Fitting a
tree"), and a batch size's entry serves every larger batch too.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch

from falcon_vllm.acceptance import best_tree, rank_profile
from falcon_vllm.config import dir_name
from falcon_vllm.drafter import FalconDrafter
from falcon_vllm.train.data import check_aux, split_held_out
from falcon_vllm.train.gen_data import load_shards
from falcon_vllm.tree import DecodingTree


@torch.inference_mode()
def verify_cost(target, batch_size: int, width: int, prefix: int = 256, repeats: int = 3,
                head_on_every_row: bool = True) -> float:
    """Seconds for one target forward of ``batch_size`` x ``width`` tokens over a ``prefix`` cache (the
    LM head on every row, as verification needs, or on the last row only)."""
    from transformers import DynamicCache

    V = target.config.vocab_size
    ids = torch.randint(0, V, (batch_size, prefix))
    cache = DynamicCache(config=target.config)
    target.base_model(input_ids=ids, use_cache=True, past_key_values=cache)
    x = torch.randint(0, V, (batch_size, width))
    pos = (prefix + torch.arange(width)).expand(batch_size, width)
    best = math.inf
    for _ in range(repeats):
        c = _clone_cache(cache, target.config)
        t0 = time.perf_counter()
        h = target.base_model(input_ids=x, position_ids=pos, past_key_values=c, use_cache=True).last_hidden_state
        target.get_output_embeddings()(h if head_on_every_row else h[:, -1:])
        best = min(best, time.perf_counter() - t0)
    return best


def _clone_cache(cache, config):
    from transformers import DynamicCache

    c = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        c.update(layer.keys.clone(), layer.values.clone(), i)
    return c


def choose_trees(profiles, cost_fn, batch_sizes, widths, k: int, draft_pass_cost: float,
                 min_gain: float = 1.0) -> dict:
    """For each batch size pick the tree size maximising tau / step time; no speculation (0 nodes) where even that
    tree's modelled speedup stays below ``min_gain`` (the tree it would have drafted kept under ``fitted``)."""
    results = {}
    for B in batch_sizes:
        base = cost_fn(B, 1)  # plain decoding: one token per request per step
        plain = {"num_nodes": 0, "tau": 1.0, "step_s": base, "tokens_per_s_per_req": 1.0 / base, "paths": []}
        best = plain
        for W in widths:
            paths, tau = best_tree(profiles, W)
            if not paths:
                continue
            depth = max(len(p) for p in paths)
            step = cost_fn(B, 1 + len(paths)) + math.ceil(depth / k) * draft_pass_cost
            rate = tau / step
            if rate > best["tokens_per_s_per_req"]:
                best = {"num_nodes": len(paths), "tau": tau, "step_s": step, "tokens_per_s_per_req": rate,
                        "paths": paths}
        best["speedup_model"] = best["tokens_per_s_per_req"] * base
        if best["num_nodes"] and best["speedup_model"] < min_gain:
            best = {**plain, "speedup_model": 1.0,
                    "fitted": {"paths": best["paths"], "speedup_model": best["speedup_model"]}}
        results[B] = best
    return results


@torch.inference_mode()
def drafter_pass_cost(drafter, topk: int, blocks: int = 8) -> float:
    """Seconds of one drafter pass over ``blocks`` k-token blocks (a pass drafts one block per expansion node),
    the median of five runs after a warm-up."""
    x = torch.randn(blocks, drafter.k, drafter.config.hidden_size)
    pos, mask = torch.arange(drafter.k).expand(blocks, -1), torch.ones(drafter.k, drafter.k, dtype=torch.bool)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        out, _ = drafter(x, x, pos, mask)
        drafter.topk_tokens(out, topk)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


# ---------------------------------------------------------------------- CLI
def add_arguments(p):
    p.add_argument("--target", default=None, help="target HF dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", required=True, help="Falcon drafter directory")
    p.add_argument("--data", default=None,
                   help="gen-data directory: profile on its held-out conversations (the last 1/16, never trained "
                        "on), with their stored features; default: --dataset prompts generated here")
    p.add_argument("--dataset", default="mt-bench", help="prompts: mt-bench, humaneval or gsm8k")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=96, help="greedy tokens generated per prompt")
    p.add_argument("--max-depth", type=int, default=8)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--widths", default="2,4,8,16,24,32,48,64,96,128")
    p.add_argument("--cost", choices=["vllm", "transformers"], default="vllm",
                   help="where the verify cost of W tokens is measured: a step of the vLLM engine serving the "
                        "target (default), or a transformers forward")
    p.add_argument("--compile", action="store_true", help="--cost vllm: time the compiled engine, as served")
    p.add_argument("--min-gain", type=float, default=1.1,
                   help="draft at a batch size only where the best tree's modelled speedup reaches this (default "
                        "1.1: the model times prefill-shaped steps, a few percent off a served step, and a batch "
                        "size's entry also serves every larger batch)")
    p.add_argument("--out", required=True, help="output JSON (loadable as a tree: `tree: <file>`)")


def sizes(text: str, flag: str) -> list[int]:
    """A comma-separated list of positive integers (``--batch-sizes``, ``--widths``), or one clear error."""
    try:
        got = [int(x) for x in text.split(",")]
    except ValueError:
        got = []
    if not got or min(got) < 1:
        raise ValueError(f"falcon-vllm: tune-tree: {flag} must be positive integers separated by commas, got {text!r}")
    return got


def main(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tqdm import tqdm

    from falcon_vllm.models import chat_ids, load_chat_prompts, model_path

    bs, widths = sizes(args.batch_sizes, "--batch-sizes"), sizes(args.widths, "--widths")  # before any work
    if not args.min_gain > 0:
        raise ValueError(f"falcon-vllm: tune-tree: --min-gain must be a speedup above 0 (e.g. 1.1), "
                         f"got {args.min_gain}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.manual_seed(0)
    tpath = args.target or str(model_path())
    tok = AutoTokenizer.from_pretrained(tpath)
    target = AutoModelForCausalLM.from_pretrained(tpath, dtype=torch.float32).eval()
    drafter = FalconDrafter.from_pretrained(args.drafter, target.config)
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    profiles = []
    if args.data:  # held-out conversations of a gen-data set (the trainer's split): stored tokens and features
        aux = drafter.config.aux_layers
        data = [s if aux else s.without_aux() for s in load_shards(args.data, aux=bool(aux))]
        check_aux(aux, data, target.config.hidden_size, args.data)  # the input the drafter reads
        held = split_held_out(data)[1][:args.num_prompts]
        for s in tqdm(held, desc="rank profile (held-out)"):
            roots = list(range(max(s.answer_start(), drafter.k), len(s.tokens) - args.max_depth - 1, 2))
            profiles += rank_profile(drafter, s.tokens, s.features.float(), args.max_depth, args.topk, roots)
    for q in tqdm(load_chat_prompts(args.dataset, args.num_prompts) if not args.data else [], desc="rank profile"):
        ids = chat_ids(tok, [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True)
        x = torch.tensor([ids])
        with torch.inference_mode():
            seq = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.gen_tokens,
                                  do_sample=False)[0]
            feats = target.base_model(input_ids=seq[None]).last_hidden_state[0]
        roots = list(range(len(ids), len(seq) - args.max_depth - 1, 2))
        profiles += rank_profile(drafter, seq, feats, args.max_depth, args.topk, roots)
    draft_cost = drafter_pass_cost(drafter, args.topk)  # before vLLM's engine binds this process's threads
    memo = {}
    if args.cost == "vllm":  # every (B, 1 + W) measured up front in one engine
        from falcon_vllm.vllm.verify_cost import measure

        with tqdm(total=len(bs) * (len(widths) + 1), desc="verify cost in vLLM") as bar:
            memo.update(measure(tpath, bs, [1 + w for w in widths], compile=args.compile, progress=bar))

    def cost(B, W):
        if args.cost == "vllm":  # a tree smaller than every width asked for: the next measured width up
            return memo[(B, min(w for b, w in memo if b == B and w >= W))]
        if (B, W) not in memo:
            memo[(B, W)] = verify_cost(target, B, W)
        return memo[(B, W)]

    res = choose_trees(profiles, cost, tqdm(bs, desc="cost model"), widths, drafter.k, draft_cost, args.min_gain)
    # the main tree is the largest one (vLLM's K); each batch size drafts its own (0 nodes: no speculation)
    largest = max(res.values(), key=lambda r: r["num_nodes"])
    out = {"paths": largest["paths"] or [[0]], "k": drafter.k, "by_batch_size": {str(b): r for b, r in res.items()},
           "samples": len(profiles), "costs_s": {f"{b}x{w}": t for (b, w), t in sorted(memo.items())},
           "cost_model": args.cost, "drafter_pass_s": draft_cost,
           "dataset": f"held-out of {dir_name(args.data)}" if args.data else args.dataset,
           "drafter": dir_name(args.drafter)}  # names, not paths: the file may ship as a drafter's serving.json
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for b, r in res.items():
        print(f"batch {b:3d}: {r['num_nodes']:4d} nodes, expected tau {r['tau']:.2f}, "
              f"modelled speedup {r['speedup_model']:.2f}x" + (
                  f" (its best tree, {len(r['fitted']['paths'])} nodes, modelled {r['fitted']['speedup_model']:.2f}x "
                  f"< --min-gain {args.min_gain}: no drafts)" if "fitted" in r else ""))
    DecodingTree(out["paths"], drafter.k)  # validates
    print(f"wrote {args.out}")
    if largest["num_nodes"] == 0:
        print("no tree pays off at any batch size on this machine with this drafter: this file serves with "
              "drafting off at every batch size (a step then costs what a vanilla step costs); serve without "
              "a speculative config, or train a stronger drafter")
    return 0
