#!/usr/bin/env python
"""The drafter's matmuls on this CPU in each ``draft_gemm_dtype``: fp32, bf16 and int8, 1 to a few rows.

Every linear layer a drafter pass runs (the fc fusion, each decoder layer's q/k/v, o, gate/up and down, then
its truncated LM head), each through the path the plugin serves it with (``falcon_vllm.vllm.model``'s
``cast_gemm_weights``, vLLM's CPU GEMM dispatch, then ``wrap_gemms``: bf16 weights with inputs cast to bf16 and
outputs back, or ``int8_linear``, vLLM's oneDNN W8A8 kernels).  ``--copies`` drafters' worth of
weights, each its own, are swept in turn, so the weights stream from memory as they do in a real step (where the
target's weights evict the drafter's from cache).  The time of one drafter's sweep, best of ``--rounds``, the dtypes
and row counts interleaved so drift hits them alike.  This is what ``draft_gemm_dtype`` auto is chosen from
(``falcon_vllm.vllm.model.auto_gemm_dtype``); end to end, compare with ``ab_step.py`` and
``falcon%draft_gemm_dtype=...`` configurations.

  python benchmarks/draft_gemm_dtypes.py --name draft_gemm_dtypes_avx512
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

TORCH_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "int8": torch.int8}  # the drafter's matmul dtypes (None: the model's, fp32)
DTYPES = tuple(TORCH_DTYPES)


def drafter_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of one Falcon drafter pass (fc fusion), from its ``config.json``."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd
    layer = [(qkv, h), (cfg["num_attention_heads"] * hd, h), (2 * inter, h), (h, inter)]
    head = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    return [(h, 2 * h)] + layer * cfg["num_hidden_layers"] + [(head, h)]


def linear_fn(weight, dtype: str):
    """``x (fp32) -> x @ weight.T`` (fp32) through the plugin's own path for a drafter matmul in ``dtype``: the
    weight cast as the drafter loads it (``cast_gemm_weights``), vLLM's CPU GEMM dispatch as for any linear layer,
    then the plugin's input casts or int8 kernels (``wrap_gemms``)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from falcon_vllm.vllm.model import cast_gemm_weights, wrap_gemms

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    cast_gemm_weights([layer], TORCH_DTYPES[dtype])
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    wrap_gemms(layer)
    return lambda x: layer.cpu_linear(x, layer.weight, None)


def measure(shapes, rows, copies: int, rounds: int) -> dict[tuple[str, int], float]:
    """ms of one drafter's sweep per (dtype, rows), best of ``rounds``."""
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) * 0.02 for n, k in shapes] for _ in range(copies)]
    fns = {d: [[(linear_fn(w, d), w.shape[1]) for w in ws] for ws in weights] for d in DTYPES}
    xs = {(m, k): torch.randn(m, k) for m in rows for k in {k for _, k in shapes}}
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for m in rows:
                for d in DTYPES:
                    t = time.perf_counter()
                    for sweep in fns[d]:
                        for f, k in sweep:
                            f(xs[(m, k)])
                    ms = (time.perf_counter() - t) / copies * 1e3
                    best[(d, m)] = min(best.get((d, m), ms), ms)
    return best


def main() -> int:
    from harness.engines import command_line
    from harness.machine import cpu_name
    from harness.paths import DEFAULT_DRAFTER, RESULTS
    from harness.report import write_report

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="drafter directory (its config.json gives the shapes)")
    p.add_argument("--rows", default="1,2,3,4,6,9")
    p.add_argument("--copies", type=int, default=8, help="drafters' worth of weights swept in turn")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--name", default="draft_gemm_dtypes")
    args = p.parse_args()
    from falcon_vllm.vllm.model import auto_gemm_dtype

    with open(os.path.join(args.drafter, "config.json")) as f:
        shapes = drafter_shapes(json.load(f))
    rows = [int(r) for r in args.rows.split(",")]
    best = measure(shapes, rows, args.copies, args.rounds)
    auto = {t: d for d, t in TORCH_DTYPES.items()}[auto_gemm_dtype()]
    cmd = command_line("draft_gemm_dtypes.py")
    result = {"command": cmd, "machine": cpu_name(), "threads": torch.get_num_threads(),
              "drafter": os.path.basename(os.path.normpath(args.drafter)), "linear_layers": len(shapes),
              "weight_mib_fp32": sum(n * k for n, k in shapes) * 4 / 2**20, "copies": args.copies, "auto": auto,
              "rows": [{"rows": m, **{d: round(best[(d, m)], 3) for d in DTYPES}} for m in rows]}
    lines = [f"# A drafter pass's matmuls per draft_gemm_dtype: {args.name}", "", f"Command: `{cmd}`", "",
             f"Machine: {result['machine']}; {result['threads']} torch threads.  The {len(shapes)} linear layers of a "
             f"{result['drafter']} pass ({result['weight_mib_fp32']:.1f} MiB in fp32), {args.copies} copies swept in "
             f"turn so the weights stream from memory; ms per drafter sweep, best of {args.rounds} rounds.  "
             f"`auto` on this CPU: {result['auto']}.", "",
             "| rows | fp32 ms | bf16 ms | int8 ms | int8 / bf16 |", "|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['fp32']:.3f} | {r['bf16']:.3f} | {r['int8']:.3f} | {r['int8'] / r['bf16']:.2f} |"
              for r in result["rows"]]
    write_report(RESULTS, args.name, result, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
