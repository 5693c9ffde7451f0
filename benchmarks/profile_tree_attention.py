#!/usr/bin/env python
"""Batch-1 tree attention on a CUDA GPU: every split-KV merge variant x tile x split count, timed as CUDA-graph
replays (the way vLLM runs a decode step), plus the torch profiler's device time per launch for the fastest.

    python benchmarks/profile_tree_attention.py --name kernels_b1_variants_h100
    TRITON_INTERPRET=1 python benchmarks/profile_tree_attention.py --smoke   # CPU: checks the script only

Merge variants: the prefix splits' partials in fp32 or in q's dtype ("half"), merged by a separate combine
launch or by the last split to arrive ("fused": one launch).  ``separate-fp32`` is the scheme before fused
merging.  The goal shape is B=1, W=128, prefix 2048, 7B heads (32 x 128); its floor is the prefix K/V read
once at peak HBM bandwidth.  Writes ``<out-dir>/<name>.{json,md}``.
"""

import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench_kernels import HEADS, bench, make_case, peak_bandwidth
from harness.paths import RESULTS

from falcon_vllm.kernels.tree_attention import default_config, tree_attention, tree_attention_ref

MERGES = {"separate-fp32": {"fuse_combine": False, "partials": "fp32"},
          "separate-half": {"fuse_combine": False, "partials": "half"},
          "fused-fp32": {"fuse_combine": True, "partials": "fp32"},
          "fused-half": {"fuse_combine": True, "partials": "half"}}
GOAL = ("7b", 128, 2048)
OTHER = (("7b", 8, 4096), ("7b", 32, 2048), ("7b", 64, 2048), ("7b", 128, 4096), ("7b", 256, 2048),
         ("13b", 128, 2048), ("gqa8", 32, 2048), ("gqa8", 128, 4096))


def launches(call) -> dict:
    """Device microseconds per kernel launch (mean of 20 eager calls) by kernel name."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            call()
        torch.cuda.synchronize()
    return {e.key[:24]: round(e.device_time_total / e.count, 1) for e in prof.key_averages() if e.device_time_total > 0}


def run_shape(heads, W, P, tiles, splits_list, peak, smoke=False, merges=tuple(MERGES)):
    Hq, Hkv, D = (4, 2, 64) if smoke else HEADS[heads]
    case, parents = make_case(1, W, P, Hq, Hkv, D, torch.float32 if smoke else torch.float16,
                              "cpu" if smoke else "cuda")
    ref = tree_attention_ref(**case, scale=D ** -0.5).float()
    kv_bytes = 2 * P * Hkv * D * 2 + W * (2 * Hq + 2 * Hkv) * D * 2
    rows = []
    for merge in merges:
        for tile in tiles:
            for splits in splits_list:
                cfg = {**MERGES[merge], **tile}

                def call():
                    return tree_attention(**case, scale=D ** -0.5, max_query_len=W, max_prefix_len=P,
                                          num_splits=splits, config=cfg)
                try:
                    err = float((call().float() - ref).abs().max())
                    ms = bench(call, smoke)
                except Exception as e:  # e.g. a tile that does not fit in shared memory
                    print(f"{heads} W={W} P={P} {merge} {tile} splits={splits}: {type(e).__name__}", flush=True)
                    continue
                rows.append(dict(heads=heads, width=W, prefix=P, merge=merge, balance=bool(cfg.get("balance")),
                                 block_m=cfg.get("block_m", "auto"),
                                 num_warps=cfg.get("num_warps", "auto"), block_n=cfg.get("block_n", "auto"),
                                 num_stages=cfg.get("num_stages", "auto"), num_splits=splits or "auto", ms=ms,
                                 max_abs_err=err, pct_peak=100 * kv_bytes / (ms * 1e-3) / peak if peak else None))
                print(f"{heads} W={W} P={P} {merge:13s} {tile} splits={splits or 'auto'}: {ms * 1e3:.1f} us "
                      f"err {err:.1e}", flush=True)
    sdpa = None
    try:
        from bench_kernels import dense_inputs
        Q, K, V, mask = dense_inputs(case, parents, 1, W, P)
        sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            Q, K, V, attn_mask=mask, scale=D ** -0.5, enable_gqa=Hq != Hkv), smoke)
    except Exception as e:  # the SDPA baseline is context, not the check
        print("sdpa baseline failed:", e)
    for r in rows:
        r["sdpa_ms"], r["speedup_vs_sdpa"] = sdpa, (sdpa / r["ms"] if sdpa else None)
    best = min(rows, key=lambda r: r["ms"])
    cfg = {**MERGES[best["merge"]], "balance": best["balance"],
           **{key: best[key] for key in ("block_m", "num_warps", "block_n", "num_stages") if best[key] != "auto"}}
    splits = None if best["num_splits"] == "auto" else best["num_splits"]
    prof = {}
    for label, c in () if smoke else (("best", cfg), ("separate-fp32 default", MERGES["separate-fp32"])):
        prof[label] = launches(lambda: tree_attention(**case, scale=D ** -0.5, max_query_len=W, max_prefix_len=P,
                                                      num_splits=splits if label == "best" else None, config=c))
    return rows, prof


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="kernels_b1_variants")
    p.add_argument("--smoke", action="store_true", help="CPU: two tiny shapes under TRITON_INTERPRET=1")
    p.add_argument("--pipeline", action="store_true",
                   help="instead: the fused-half merge over key tile (block_n) x pipeline stages x splits, the goal "
                        "shape also over tile rows x warps, the others over in-flight keys shared among the splits "
                        "or not (balance)")
    p.add_argument("--launches", type=int, default=0,
                   help="instead: only this many eager launches of the goal shape's default (for Nsight Compute: "
                        "ncu --kernel-name _tree_attn_fwd --launch-skip 2 --launch-count 1 ...)")
    p.add_argument("--out-dir", default=RESULTS)
    a = p.parse_args(argv)
    if a.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if not a.smoke and not torch.cuda.is_available():
        print("profile_tree_attention: needs a CUDA GPU (or --smoke on CPU)", file=sys.stderr)
        return 2
    if a.launches:
        Hq, Hkv, D = HEADS[GOAL[0]]
        case, _ = make_case(1, GOAL[1], GOAL[2], Hq, Hkv, D, torch.float16, "cuda")
        for _ in range(a.launches):
            tree_attention(**case, scale=D ** -0.5, max_query_len=GOAL[1], max_prefix_len=GOAL[2])
        torch.cuda.synchronize()
        print("default_config:", default_config(GOAL[1], Hq // Hkv, D), "(num_stages 3 where the prefix is split)")
        return 0
    dev = "CPU, Triton interpreter (timings mean nothing)" if a.smoke else torch.cuda.get_device_name()
    peak = None if a.smoke else peak_bandwidth(dev)
    res = {"device": dev, "torch": torch.__version__, "timing": "median of CUDA-graph replays (do_bench)",
           "command": "python benchmarks/profile_tree_attention.py " + " ".join(argv or sys.argv[1:]), "shapes": []}
    tiles = ({"block_m": 64, "num_warps": 4}, {"block_m": 128, "num_warps": 8})
    if a.pipeline:
        pipe = [{"block_n": n, "num_stages": 3, "balance": bal} for n in (64, 128) for bal in (False, True)]
        # the goal shape also with 64-row tiles over 8 warps (Nsight Compute, ncu_b1_goal_h100.txt: 208 registers
        # per thread at 4 warps hold an SM to 2 programs) and 128-row tiles (MHA: one tile per head reads the
        # prefix once), 2 or 3 stages, 32- or 64-key tiles
        goal_pipe = [{"block_m": m, "num_warps": w, "block_n": n, "num_stages": st}
                     for m, w in ((64, 4), (64, 8), (128, 8)) for n in (32, 64) for st in (2, 3)]
        shapes = ([(GOAL[0], 6, 40, (None, 4))] if a.smoke else
                  [(*GOAL, (4, 8)), ("7b", 64, 2048, (4, 8)), ("7b", 8, 4096, (8, 16)), ("7b", 32, 2048, (8, 16))])
        for heads, W, P, spl in shapes:
            tiles_here = pipe[:2] if a.smoke else goal_pipe if (heads, W, P) == GOAL else pipe
            rows, prof = run_shape(heads, W, P, tiles_here, spl, peak, a.smoke, ("fused-half",))
            res["shapes"].append({"shape": (heads, W, P), "rows": rows, "launch_us": prof})
            write(res, a.out_dir, a.name)
    goal, other = ((GOAL[0], 6, 40), [("7b", 3, 20)]) if a.smoke else (GOAL, OTHER)
    if not a.pipeline:
        rows, prof = run_shape(*goal, tiles, (None, 4) if a.smoke else (None, 4, 8, 16), peak, a.smoke)
        res["shapes"].append({"shape": goal, "rows": rows, "launch_us": prof})
        write(res, a.out_dir, a.name)
    for heads, W, P in () if a.pipeline else other:
        rows, prof = run_shape(heads, W, P, ({},), (None,), peak, a.smoke)
        res["shapes"].append({"shape": (heads, W, P), "rows": rows, "launch_us": prof})
    lines = write(res, a.out_dir, a.name)
    print("\n".join(lines[-40:]))
    return 0


def write(res: dict, out_dir: str, name: str) -> list[str]:
    """<out_dir>/<name>.{json,md} from the shapes measured so far (rewritten after each shape, so a run cut
    short by a time limit keeps what it measured); returns the markdown lines."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Batch-1 tree attention, split-KV merge variants: {res['device']}", "",
             f"Command: `{res['command']}`", "",
             "Timing: median of CUDA-graph replays (triton.testing.do_bench, L2 flushed); fp16; % peak: prefix K/V "
             "+ in-flight q/k/v/out bytes over the time, against the datasheet HBM bandwidth.  launch us: torch "
             "profiler device time per launch, eager.", ""]
    for s in res["shapes"]:
        heads, W, P = s["shape"]
        lines += [f"## {heads} heads, W={W}, prefix {P}" + (" (the goal shape)" if tuple(s["shape"]) == GOAL else ""),
                  "", "| merge | block_m | warps | block_n | stages | splits | us | % peak | vs SDPA+mask "
                  "| max abs err |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(s["rows"], key=lambda r: r["ms"]):
            pct = f"{r['pct_peak']:.0f}%" if r["pct_peak"] else "-"
            vs = f"{r['speedup_vs_sdpa']:.2f}x" if r["speedup_vs_sdpa"] else "-"
            merge = r["merge"] + (" +balance" if r.get("balance") else "")
            lines.append(f"| {merge} | {r['block_m']} | {r['num_warps']} | {r['block_n']} | {r['num_stages']} | "
                         f"{r['num_splits']} | "
                         f"{r['ms'] * 1e3:.1f} | {pct} | {vs} | {r['max_abs_err']:.1e} |")
        lines += ["", "launch us: " + "; ".join(f"{k}: {v}" for k, v in s["launch_us"].items()), ""]
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write("\n".join(lines))
    return lines


if __name__ == "__main__":
    sys.exit(main())
