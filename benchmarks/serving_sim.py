#!/usr/bin/env python
"""Offline model of batch-1 greedy serving: tokens per step of a drafting policy, without vLLM.

For every answer position of the held-out benchmark sets (the target's greedy answers with its true
features: ``heldout_eval.py``'s sets), the drafter drafts a chain as vLLM's proposer does: a causal pass
over the committed positions, the last k of them as one relaxed block, then SAR passes on the tokens and
features it drafted.  Greedy verification accepts the drafts' longest prefix that matches the target's
tokens, so walking each answer step by step gives, for any policy, exactly the steps vLLM would take
(up to the drafter's matmul precision; vLLM's matches are also vLLM's n-gram matcher here):

  chain:F            the drafter's chain of F tokens every step
  lookup:K:F:L:N     prompt lookup first (n-grams N..4, up to K tokens, adaptive from L as the proposer's
                     ``lookup_tokens``), the drafter's chain of F otherwise (the shipped default's form)
  falcon             the drafter's ``serving.json`` at batch 1 (lookup or chain, as the plugin serves it; a
                     datastore it names is not modelled)
  ngram:K            vLLM's n-gram proposer alone (K tokens, n-grams 2..4; no drafter)

Reported per drafter, dataset and policy: tokens per step (bonus included), verified draft rows and
drafter passes per step, and a speedup estimate from a linear step-cost model (``--costs``, ms):

  step = vanilla + overhead + pass * drafter passes + row * verified draft rows

calibrated by ``profile_step.py`` on the machine in question (the defaults: the 2-core AMD EPYC,
``profile_trees_b1_epyc.md``: vanilla 33.8 ms, a chain of 2 39.7 ms with a 4.3 ms drafter pass, 0.3 ms a
verified row).  A drafter policy runs one drafter pass on lookup steps too (the chunk pass that keeps the
drafter's KV cache whole).  Only the tokens per step are exact; the estimate is as good as the cost model.

  python benchmarks/serving_sim.py --drafter falcon=falcon_vllm/drafters/smollm2-135m-instruct \\
      --policies falcon,chain:2,chain:4,lookup:8:2:8,ngram:4 --name serving_sim_smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

from harness.paths import RESULTS
from harness.prompts import DATASETS, eval_set
from harness.report import write_report

DEFAULT_COSTS = {"vanilla": 33.8, "overhead": 1.0, "pass": 4.3, "row": 0.3}


# ------------------------------------------------------------------------------------ drafts
def chain_drafts(drafter, tokens: torch.Tensor, feats: torch.Tensor, start: int, depth: int) -> dict[int, list[int]]:
    """The drafter's chain of ``depth`` tokens at every root n >= ``start`` (n committed positions after the
    first token: tokens[0..n] are known, tokens[n+1..] are drafted), as vLLM's proposer computes it.

    Drafter position j reads (tokens[j+1], feats[j]).  One causal pass over all positions gives their K/V;
    at root n the last k positions (n-k..n-1) run again as one relaxed block over the K/V before them, and
    each further block reads the tokens drafted by the one before and its output features.  (vLLM's cache
    keeps, for a position that was in an earlier step's relaxed block, that block's K/V; here every prefix
    position has its causal K/V.  The two differ from the drafter's second layer on, by as little as
    ``heldout_eval.py --context causal`` measures against ``relaxed``.)"""
    from falcon_vllm.drafter import chunk_mask

    k = drafter.config.k
    L = tokens.shape[0]
    dev = tokens.device
    with torch.no_grad():
        _, kv = drafter(drafter.embed(tokens[1:L][None]), feats[:L - 1][None], torch.arange(L - 1, device=dev)[None],
                        torch.ones(L - 1, L - 1, dtype=torch.bool, device=dev).tril())
        out = {}
        for n in range(max(start, k), L - 1):
            past = [(a[:, :, :n - k], b[:, :, :n - k]) for a, b in kv]
            ids, f, pos = tokens[n - k + 1:n + 1], feats[n - k:n], torch.arange(n - k, n, device=dev)
            mask = chunk_mask(n - k, k, k, device=dev)
            drafted: list[int] = []
            while True:
                rows, new = drafter(drafter.embed(ids[None]), f[None], pos[None], mask, past)
                drafted += drafter.topk_tokens(rows[0], 1)[:, 0].tolist()
                if len(drafted) >= depth:
                    break
                past = [(torch.cat([a, c], 2), torch.cat([b, d], 2)) for (a, b), (c, d) in zip(past, new)]
                ids, f, pos = torch.tensor(drafted[-k:], device=dev), rows[0], pos + k
                mask = torch.ones(k, past[0][0].shape[2] + k, dtype=torch.bool, device=dev)
            out[n] = drafted[:depth]
    return out


# ------------------------------------------------------------------------------------ policies
def parse_policy(spec: str, serving: dict | None) -> dict:
    """A policy name -> {"lookup": (K, L, N, M) or None, "drafter": F (0: none)}: lookup up to K tokens (adaptive
    from L), n-grams N..M; the drafter's chain of F tokens."""
    kind, _, arg = spec.partition(":")
    if kind not in ("falcon", "chain", "lookup", "ngram") or not all(x.isdigit() for x in arg.split(":") if x):
        raise SystemExit(f"serving_sim: unknown policy {spec!r} (chain:F, lookup:K:F:L:N, falcon, ngram:K)")
    parts = [int(x) for x in arg.split(":") if x]
    if kind == "falcon":
        if serving is None:
            raise SystemExit("serving_sim: policy 'falcon' needs a drafter with a serving.json")
        K = serving.get("num_speculative_tokens", 2)
        if serving.get("prompt_lookup_max"):
            return {"lookup": (K, serving.get("lookup_tokens") or K, serving.get("prompt_lookup_min", 2),
                               serving["prompt_lookup_max"]),
                    "drafter": serving.get("drafter_tokens", serving.get("falcon_tokens", min(K, 2)))}
        return {"lookup": None, "drafter": K}
    if kind == "chain":
        return {"lookup": None, "drafter": parts[0] if parts else 2}
    if kind == "lookup":
        K, F, L, N = (parts + [None] * 4)[:4]
        K = K or 4
        return {"lookup": (K, L or K, N or 2, 4), "drafter": F or min(K, 2)}
    K = parts[0] if parts else 4
    return {"lookup": (K, K, 2, 4), "drafter": 0}  # ngram


def accepted(draft, truth) -> int:
    """Tokens of ``draft`` the greedy target accepts: the common prefix with its own continuation."""
    n = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        n += 1
    return n


def walk(tokens: list[int], start: int, drafts: dict[int, list[int]] | None, policy: dict, k: int = 1) -> list[dict]:
    """Greedy serving of one answer from root ``start`` to the end of ``tokens``: one record per step with the
    accepted drafts, the verified rows and the drafter passes run.  ``drafts``: chain_drafts' output (needed
    when the policy drafts with the drafter); ``k``: the drafter's block size (tokens per pass)."""
    state = None
    if policy["lookup"] is not None:  # the proposer's own lookup (vLLM's matcher, its adaptive lengths)
        from falcon_vllm.core.lookup import LookupState

        K, L0, N, M = policy["lookup"]
        state = LookupState(N, M, policy["drafter"], L0 if L0 < K else None)
    toks = np.asarray(tokens, dtype=np.int32)[None]
    end = len(tokens) - 1          # the index of the last token to produce
    steps = []
    n = start
    while n < end:
        draft, passes = [], 0
        if state is not None:
            draft = state.draft(["r"], toks, np.array([n + 1]), None, np.array([True]), K, 1 << 20)[0]
        looked_up = bool(draft)
        if looked_up:
            a = accepted(draft, tokens[n + 1:])
            passes = 1 if policy["drafter"] else 0              # the drafter's chunk pass still runs
        elif policy["drafter"]:
            draft = drafts[n][:policy["drafter"]]
            passes = math.ceil(len(draft) / k)
            a = accepted(draft, tokens[n + 1:])
        else:
            a = 0
        a = min(a, end - n - 1)    # the answer ends: only what is left to produce counts
        steps.append({"n": n, "rows": len(draft), "accepted": a, "passes": passes, "lookup": looked_up})
        n += a + 1
    return steps


def summarise(steps: list[dict], costs: dict) -> dict:
    S = len(steps)
    tokens = sum(s["accepted"] + 1 for s in steps)
    rows = sum(s["rows"] for s in steps)
    passes = sum(s["passes"] for s in steps)
    ms = S * (costs["vanilla"] + costs["overhead"]) + costs["pass"] * passes + costs["row"] * rows
    return {"steps": S, "tokens": tokens, "tokens_per_step": round(tokens / max(1, S), 4),
            "rows_per_step": round(rows / max(1, S), 3), "passes_per_step": round(passes / max(1, S), 3),
            "lookup_share": round(sum(s["lookup"] for s in steps) / max(1, S), 3),
            "est_speedup": round(tokens * costs["vanilla"] / ms, 3) if ms else None}


# ------------------------------------------------------------------------------------ main
def parse_costs(text: str, pass_ms: str) -> tuple[dict, dict]:
    costs = dict(DEFAULT_COSTS)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in costs:
            raise SystemExit(f"serving_sim: --costs takes {', '.join(costs)}; got {key!r}")
        costs[key] = value
    per = {}
    for item in filter(None, pass_ms.split(",")):
        label, _, value = item.partition("=")
        per[label] = value
    try:
        return {k: float(v) for k, v in costs.items()}, {k: float(v) for k, v in per.items()}
    except ValueError as e:
        raise SystemExit(f"serving_sim: --costs / --pass-ms take key=<ms>: {e}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", action="append", required=True, help="label=<drafter dir> (Falcon or vLLM EAGLE)")
    p.add_argument("--policies", default="falcon,chain:2,ngram:4")
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--costs", default="", help="vanilla=,overhead=,pass=,row= (ms; defaults: "
                   + ", ".join(f"{k}={v}" for k, v in DEFAULT_COSTS.items()) + ")")
    p.add_argument("--pass-ms", default="", help="label=ms: a drafter's own pass cost (e.g. a 1-layer EAGLE's)")
    p.add_argument("--work", default=".cache/heldout-eval")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default="serving_sim")
    p.add_argument("--out-dir", default=RESULTS)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.models import model_path

    costs, pass_ms = parse_costs(a.costs, a.pass_ms)
    t0 = time.time()
    target_dir = a.model or str(model_path())
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        sets = {d: eval_set(d, a.num_prompts, a.max_new_tokens, a.work, target_dir, target)
                for d in a.datasets.split(",") if d}
    rows = []
    for item in a.drafter:
        label, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"serving_sim: --drafter takes label=<dir>, got {item!r}")
        d = FalconDrafter.load(path, target.config).eval()
        d.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
        serving_file = os.path.join(path, "serving.json")
        serving = json.load(open(serving_file)) if os.path.exists(serving_file) else None
        # "falcon" (the drafter's serving.json) only for drafters that have one; ngram rows once (no drafter)
        policies = {s: parse_policy(s, serving) for s in a.policies.split(",")
                    if s and (s != "falcon" or serving is not None) and not (s.startswith("ngram") and rows)}
        depth = max([pol["drafter"] for pol in policies.values()] + [1])
        c = dict(costs, **({"pass": pass_ms[label]} if label in pass_ms else {}))
        for name, samples in sets.items():
            walks = {s: [] for s in policies}
            for smp in samples:
                toks = smp.tokens.long()
                start = smp.answer_start()
                drafts = chain_drafts(d, toks, smp.hidden.float(), start, depth)
                for s, pol in policies.items():
                    walks[s] += walk(toks.tolist(), max(start, d.config.k), drafts, pol, d.config.k)
            for s, pol in policies.items():
                none = pol["drafter"] == 0  # vLLM's n-gram proposer: no drafter
                row = {"drafter": "(none)" if none else label, "dir": None if none else path, "k": d.config.k,
                       "dataset": name, "policy": s,
                       "answers": len(samples), **summarise(walks[s], c)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    res = {"command": "python benchmarks/serving_sim.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "costs": costs, "pass_ms": pass_ms, "num_prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens,
           "seconds": round(time.time() - t0, 1), "rows": rows}
    names = list(sets)
    lines = [f"# Serving policies, simulated: {a.name}", "", f"Command: `{res['command']}`", "",
             f"Batch 1, greedy: the target's answers (at most {a.max_new_tokens} tokens) to the first "
             f"{a.num_prompts} prompts of each dataset, walked step by step under each policy (`serving_sim.py`). "
             "Cells: tokens per step (bonus included) / verified draft rows per step / drafter passes per step / "
             "estimated speedup, from the step-cost model " + ", ".join(f"{k} {v} ms" for k, v in costs.items())
             + ("" if not pass_ms else " (drafter passes: " + ", ".join(f"{k} {v} ms" for k, v in pass_ms.items())
                + ")") + ".", "",
             "| drafter | policy | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for label in dict.fromkeys(r["drafter"] for r in rows):
        for s in dict.fromkeys(r["policy"] for r in rows if r["drafter"] == label):
            mine = {r["dataset"]: r for r in rows if r["drafter"] == label and r["policy"] == s}
            cells = [f"{m['tokens_per_step']:.3f} / {m['rows_per_step']:.2f} / {m['passes_per_step']:.2f} / "
                     f"{m['est_speedup']:.3f}x" for m in (mine[n] for n in names)]
            lines.append(f"| {label} | {s} | " + " | ".join(cells) + " |")
    write_report(a.out_dir, a.name, res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
