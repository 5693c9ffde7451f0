#!/usr/bin/env python
"""Study: What does verifying W tokens cost against one (the cost tune-tree fits its trees to)?

Answer: In transformers on one thread: 1.85x for W = 2 to 8, 2.4x for 16, 3.3x for 32 and 5.6x for 64.
Result: benchmarks/results/verify_cost_smollm2_quiet.md

Cost of verifying W tokens against one token: the target forward (+ LM head) of W in-flight tokens
per request over a cached prefix, W = 1..64, as a ratio to W = 1 (the knee ``falcon-vllm tune-tree`` fits
its trees to; it measures with the same function, ``falcon_vllm.tune_tree.verify_cost``).

Also reported: the share of the LM head (the target's full-vocabulary logits of every verified token) and
the cost with the LM head applied to one row only, i.e. what the layers alone cost.

  python benchmarks/studies/verify_cost.py --widths 1,2,4,8,12,16,24,32,48,64 --threads 1 --name verify_cost_smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness.machine import cpu_name  # noqa: E402
from harness.paths import RESULTS  # noqa: E402
from harness.report import write_report  # noqa: E402


def layers_only_cost(target, batch_size, width, prefix=256, repeats=3):
    """Like tune_tree.verify_cost, with the LM head applied to the last row only."""
    from falcon_vllm.tune_tree import verify_cost

    return verify_cost(target, batch_size, width, prefix, repeats, head_on_every_row=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target HF dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--widths", default="1,2,4,8,12,16,24,32,48,64")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="best of")
    p.add_argument("--threads", type=int, default=1, help="torch threads (vLLM's CPU worker binds 1 on 2 cores)")
    p.add_argument("--name", default="verify_cost")
    args = p.parse_args(argv)
    command = "python benchmarks/studies/verify_cost.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))

    import torch
    from transformers import AutoModelForCausalLM

    from falcon_vllm.models import model_path
    from falcon_vllm.tune_tree import verify_cost

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(args.target or str(model_path()), dtype=torch.float32).eval()
    widths = [int(w) for w in args.widths.split(",")]
    rows = []
    with torch.inference_mode():
        for B in (int(b) for b in args.batch_sizes.split(",")):
            verify_cost(target, B, 1, args.prefix, 2)  # warm-up
            # interleave widths over the repeats so load drift hits every width alike
            full = {W: math.inf for W in widths}
            layers = {W: math.inf for W in widths}
            for _ in range(args.repeats):
                for W in widths:
                    full[W] = min(full[W], verify_cost(target, B, W, args.prefix, 1))
                    layers[W] = min(layers[W], layers_only_cost(target, B, W, args.prefix, 1))
            for W in widths:
                rows.append({"batch_size": B, "width": W, "seconds": full[W], "ratio_to_1": full[W] / full[1],
                             "layers_only_seconds": layers[W], "layers_only_ratio_to_1": layers[W] / layers[1],
                             "lm_head_share": 1 - layers[W] / full[W]})
                print(json.dumps(rows[-1]), flush=True)
    lines = [f"# Verify cost of W tokens vs 1 ({args.name})", "", f"Command: `{command}`", "",
             f"SmolLM2-135M-Instruct fp32 (transformers), prefix {args.prefix}, {args.threads} thread(s), best of "
             f"{args.repeats} (widths interleaved).  `full`: layers + LM head on every row (what verification "
             "needs); `layers`: LM head on one row.", "",
             "| B | W | full ms | full / W=1 | layers ms | layers / W=1 | LM head share |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch_size']} | {r['width']} | {1e3 * r['seconds']:.1f} | {r['ratio_to_1']:.2f} | "
                     f"{1e3 * r['layers_only_seconds']:.1f} | {r['layers_only_ratio_to_1']:.2f} | "
                     f"{100 * r['lm_head_share']:.0f}% |")
    write_report(RESULTS, args.name, {"command": command, "machine": cpu_name(),
                 "threads": args.threads, "prefix": args.prefix, "rows": rows}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
