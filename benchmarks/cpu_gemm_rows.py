#!/usr/bin/env python
"""What verifying M rows costs in vLLM's CPU linear layers, against one row (plain decoding).

Every projection of the target (q/k/v, o, gate/up, down per layer, then the LM head), each with its own
weights (so, as in a real step, they stream from memory rather than sit in cache), through the GEMM that
vLLM's CPU backend dispatches for an unquantized layer (``dispatch_cpu_unquantized_gemm``: oneDNN with
prepacked weights on x86).  The time of one sweep over all of them for M = 1..16 rows, best of
``--rounds``.  Speculative decoding pays off where M = K+1 rows cost about what one row costs; on some
CPUs oneDNN's few-row kernels are slower than its 3-6-row ones, which makes verification cheaper than a
decode step there (and explains speedups that differ between machines).

  python benchmarks/cpu_gemm_rows.py --name cpu_gemm_rows_smollm2
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from harness.machine import cpu_name
from harness.paths import RESULTS


def linear_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of every projection of a Llama-like target, layer by layer, then the LM head."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    layer = [(qkv, h), (cfg.num_attention_heads * hd, h), (2 * inter, h), (h, inter)]
    return layer * cfg.num_hidden_layers + [(cfg.vocab_size, h)]


def measure(shapes, rows, rounds: int = 3, iters: int = 5, dtype=None) -> dict[int, float]:
    """ms of one sweep over every projection at M rows, best of ``rounds`` (each the mean of ``iters``)."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dtype = dtype or torch.float32
    layers = []
    for n, k in shapes:
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(n, k, dtype=dtype) * 0.02, requires_grad=False)
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        layers.append(layer)
    xs = {(m, k): torch.randn(m, k, dtype=dtype) for m in rows for k in {k for _, k in shapes}}

    def sweep(m):
        for layer in layers:
            x = xs[(m, layer.weight.shape[1])]
            layer.cpu_linear(x, layer.weight, None)

    best = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for m in rows:  # interleaved, so drift hits every M alike
                sweep(m)
                t = time.perf_counter()
                for _ in range(iters):
                    sweep(m)
                ms = (time.perf_counter() - t) / iters * 1e3
                best[m] = min(best.get(m, ms), ms)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target HF dir (default: SmolLM2-135M-Instruct, converted)")
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,10,12,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--name", default="cpu_gemm_rows")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoConfig

    from falcon_vllm.models import model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    target = args.target or str(model_path())
    cfg = AutoConfig.from_pretrained(target)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = linear_shapes(cfg)
    best = measure(shapes, rows, args.rounds)
    base = best[rows[0]]
    cmd = "python benchmarks/cpu_gemm_rows.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    result = {"command": cmd, "machine": cpu_name(), "threads": torch.get_num_threads(),
              "target": os.path.basename(os.path.normpath(target)), "projections": len(shapes),
              "weight_mb": sum(n * k for n, k in shapes) * 4 / 2**20,
              "rows": [{"rows": m, "ms": round(best[m], 3), "vs_first": round(best[m] / base, 3)} for m in rows]}
    lines = [f"# vLLM CPU linear cost against rows: {args.name}", "", f"Command: `{cmd}`", "",
             f"Machine: {result['machine']}; {result['threads']} torch threads.  Every projection of "
             f"{result['target']} ({len(shapes)} weights, {result['weight_mb']:.0f} MiB fp32, each its own) through "
             "vLLM's CPU GEMM dispatch; one sweep over all of them, best of "
             f"{args.rounds} rounds.  Attention, norms and the rest of a step are not included.", "",
             f"| rows M | ms per sweep | vs M={rows[0]} |", "|---|---|---|"]
    lines += [f"| {r['rows']} | {r['ms']:.2f} | {r['vs_first']:.2f}x |" for r in result["rows"]]
    from harness.report import write_report

    write_report(RESULTS, args.name, result, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
