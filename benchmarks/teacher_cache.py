#!/usr/bin/env python
"""The teacher cache in fp32 against bf16 (``train --bf16``): time per answer row and how close the two caches are,
on stored drafter data and the target's own LM head, one process, the same rows.

    python benchmarks/teacher_cache.py --model <target dir> --data <gen-data dir> --rows 4096 --name NAME

bf16 multiplies the features by the whole vocabulary's head in bf16 and recomputes the top ``topk + margin``
candidates in fp32 (``falcon_vllm.train.data.teacher_cache``); fp32 is the whole product in fp32.  Compared per
answer row: the argmax (the hard label), the top-k ids and logits (the soft loss's support), and both log-sum-exps
(its normaliser at T=1 and T=0.95).  Each way runs ``--rounds`` times in turn (fp32, bf16, fp32, ...), the best
round counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from harness.machine import cpu_name
from harness.paths import portable
from harness.report import write_report

from falcon_vllm.train.data import answer_rows, teacher_cache
from falcon_vllm.train.gen_data import load_shards


def first_rows(data_dir: str, rows: int) -> list:
    """The first conversations of ``data_dir`` holding at least ``rows`` answer rows (only the shards they are in
    are read: the manifest counts each shard's answer tokens)."""
    with open(os.path.join(data_dir, "manifest.json")) as f:
        shards, n = json.load(f)["shards"], 0
    need = next((i + 1 for i, sh in enumerate(shards) if (n := n + sh["answer_tokens"]) >= rows), len(shards))
    out, n = [], 0
    for s in load_shards(data_dir, aux=False, shards=need):
        out.append(s)
        n += answer_rows([s])
        if n >= rows:
            break
    return out


def compare(full: list, fast: list) -> dict:
    """How the bf16 cache differs from the fp32 one over the rows both computed."""
    f = {n: torch.cat([c[n] for c in full]) for n in full[0]}
    b = {n: torch.cat([c[n] for c in fast]) for n in fast[0]}
    rows = f["arg"] >= 0
    f, b = ({n: t[rows] for n, t in d.items()} for d in (f, b))
    same_set = [len(set(x.tolist()) & set(y.tolist())) / x.numel() for x, y in zip(f["idx"], b["idx"])]
    val = (f["val"] - b["val"]).abs()
    return {"rows": int(rows.sum()),
            "argmax_agree": float((f["arg"] == b["arg"]).float().mean()),
            "topk_ids_identical": float((f["idx"] == b["idx"]).all(-1).float().mean()),
            "topk_set_overlap_mean": sum(same_set) / len(same_set),
            "topk_logit_absdiff_mean": float(val.mean()), "topk_logit_absdiff_max": float(val.max()),
            **{f"{n}_absdiff_{k}": float(getattr((f[n] - b[n]).abs(), k)()) for n in ("lse", "lseT")
               for k in ("mean", "max")}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the target model directory (its LM head is the teacher)")
    p.add_argument("--data", required=True, help="a gen-data directory of that target")
    p.add_argument("--rows", type=int, default=4096, help="answer rows (whole conversations, the first ones)")
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--margin", type=int, default=16, help="bf16's extra candidates recomputed in fp32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--name", default="teacher_cache")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    head = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).get_output_embeddings()
    data = first_rows(args.data, args.rows)
    rows = answer_rows(data)
    times, caches = {"fp32": [], "bf16": []}, {}
    for _ in range(args.rounds):
        for way in times:
            t0 = time.perf_counter()
            caches[way] = teacher_cache(data, head, args.topk, bf16=way == "bf16", margin=args.margin)
            times[way].append(time.perf_counter() - t0)
    best = {w: min(t) for w, t in times.items()}
    r = {"command": " ".join(["python", "benchmarks/teacher_cache.py"] + [portable(a) for a in sys.argv[1:]]),
         "machine": cpu_name(), "threads": torch.get_num_threads(), "model": os.path.basename(args.model.rstrip("/")),
         "data": os.path.basename(args.data.rstrip("/")), "conversations": len(data), "answer_rows": rows,
         "topk": args.topk, "margin": args.margin, "rounds_s": times,
         "ms_per_row": {w: 1000 * t / rows for w, t in best.items()}, "speedup": best["fp32"] / best["bf16"],
         "agreement": compare(caches["fp32"], caches["bf16"])}
    a = r["agreement"]
    lines = [f"# Teacher cache, fp32 against bf16: {args.name}", "",
             f"Command: `{r['command']}`", "",
             f"Machine: {r['machine']}, {r['threads']} threads.  Target {r['model']}'s LM head (fp32 weights); "
             f"{rows} answer rows of the first {len(data)} conversations of `{r['data']}`; top-{args.topk}, bf16 "
             f"with {args.margin} more candidates recomputed in fp32; best of {args.rounds} rounds each.", "",
             "| teacher cache | ms per answer row | rows per s | vs fp32 |", "|---|---|---|---|"]
    for w in times:
        ms = r["ms_per_row"][w]
        lines.append(f"| {w} | {ms:.3f} | {1000 / ms:.0f} | {best['fp32'] / best[w]:.2f}x |")
    lines += ["", f"bf16 against fp32 over the same {a['rows']} rows: argmax the same on {a['argmax_agree']:.4%}; "
              f"top-{args.topk} ids identical (order too) on {a['topk_ids_identical']:.2%}, the same set "
              f"{a['topk_set_overlap_mean']:.4%} on average; top-{args.topk} logits |diff| mean "
              f"{a['topk_logit_absdiff_mean']:.2e}, max {a['topk_logit_absdiff_max']:.2e}; logsumexp |diff| mean "
              f"{a['lse_absdiff_mean']:.2e}, max {a['lse_absdiff_max']:.2e}; at T=0.95 mean "
              f"{a['lseT_absdiff_mean']:.2e}, max {a['lseT_absdiff_max']:.2e}."]
    write_report(args.out_dir, args.name, r, lines)
    return r


if __name__ == "__main__":
    main()
