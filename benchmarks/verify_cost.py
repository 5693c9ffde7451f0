#!/usr/bin/env python
"""What verifying W tokens per request costs against one, inside vLLM and in transformers, at each batch size.

The vLLM column is what ``falcon-vllm tune-tree`` fits its trees to (``falcon_vllm.vllm.verify_cost``): one engine
step of B requests x W new tokens over a cached prefix, timed at the model runner, plus the LM head on the rows
a prefill step leaves out.  The transformers column is ``tune-tree --cost transformers`` (one forward of the same
shape).  Both are measured in this one run, each against its own W = 1.

  python benchmarks/verify_cost.py --target <dir> --batch-sizes 1,4 --widths 2,4,8,12,16,24,32 --name NAME
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from harness.machine import cpu_name
from harness.paths import RESULTS, portable
from harness.report import write_report


def transformers_costs(target: str, batch_sizes, widths, prefix: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from falcon_vllm.tune_tree import verify_cost

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return {(b, w): verify_cost(model, b, w, prefix=prefix) for b in batch_sizes for w in widths}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target HF dir (default: SmolLM2-135M-Instruct, converted)")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--widths", default="2,4,8,12,16,24,32", help="tokens per request (1 is always measured)")
    p.add_argument("--prefix", type=int, default=256, help="cached context per request (vLLM: whole blocks)")
    p.add_argument("--compile", action="store_true", help="time the compiled engine")
    p.add_argument("--no-transformers", action="store_true", help="only the vLLM column")
    p.add_argument("--name", default="verify_cost", help="writes <out-dir>/<name>.{json,md}")
    p.add_argument("--out-dir", default=RESULTS, help="default: benchmarks/results")
    args = p.parse_args(argv)
    from falcon_vllm.models import model_path
    from falcon_vllm.vllm.verify_cost import measure

    target = args.target or str(model_path())
    bs = [int(b) for b in args.batch_sizes.split(",")]
    widths = sorted({1} | {int(w) for w in args.widths.split(",")})
    # transformers first: a vLLM engine binds this process's threads, which slows later torch work
    hf = {} if args.no_transformers else transformers_costs(target, bs, widths, args.prefix)
    vl = measure(target, bs, widths, prefix=args.prefix, compile=args.compile)
    cmd = "python benchmarks/verify_cost.py " + " ".join(shlex.quote(str(portable(a))) for a in (argv or sys.argv[1:]))
    rows = [{"batch_size": b, "width": w, "vllm_ms": round(vl[(b, w)] * 1e3, 3),
             "vllm_vs_1": round(vl[(b, w)] / vl[(b, 1)], 3),
             **({"transformers_ms": round(hf[(b, w)] * 1e3, 3), "transformers_vs_1": round(hf[(b, w)] / hf[(b, 1)], 3)}
                if hf else {})}
            for b in bs for w in widths]
    result = {"command": cmd, "machine": cpu_name(), "target": os.path.basename(os.path.normpath(target)),
              "prefix": args.prefix, "compiled": args.compile, "rows": rows}
    head = "| batch | W | vLLM ms | vLLM vs W=1 |" + (" transformers ms | transformers vs W=1 |" if hf else "")
    lines = [f"# Verify cost against width: {args.name}", "", f"Command: `{cmd}`", "",
             f"Machine: {result['machine']}.  Target {result['target']}, fp32, {args.prefix} cached tokens per "
             f"request, {'compiled' if args.compile else 'eager'} engine.  vLLM: one engine step of B x W tokens "
             "(timed at the model runner) plus the LM head on the rows a prefill leaves out; transformers: one "
             "forward of the same shape, LM head on every row.  Best of 3 runs each.", "",
             head, "|---|---|---|---|" + ("---|---|" if hf else "")]
    for r in rows:
        line = f"| {r['batch_size']} | {r['width']} | {r['vllm_ms']:.1f} | {r['vllm_vs_1']:.2f}x |"
        if hf:
            line += f" {r['transformers_ms']:.1f} | {r['transformers_vs_1']:.2f}x |"
        lines.append(line)
    write_report(args.out_dir, args.name, result, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
