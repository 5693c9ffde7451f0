"""``falcon-vllm bench``: the end-to-end speedup of Falcon against vanilla vLLM, both measured in one run.

It runs the repository's same-run A/B (``benchmarks/ab_step.py``): one engine per configuration in this
process, timed generations alternating between them, each divided by the baseline's generation next to it.
``falcon`` is the drafter's own recommendation (its ``serving.json``), the way ``vllm serve`` would run it.
"""

from __future__ import annotations

import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
DEFAULTS = {"configs": "vanilla,falcon", "name": "bench"}
DESCRIPTION = """\
The end-to-end speedup of Falcon against vanilla vLLM, measured in one run.

Every configuration's engine lives in this process; the timed generations alternate between them, and each
is divided by the vanilla generation next to it (median and spread over --pairs), so machine load hits both
alike.  Greedy outputs are checked token for token against vanilla.  Writes
benchmarks/results/<name>.json and .md (tokens/s, speedup, steps per generation, drafting ms per step).

examples:
  falcon-vllm bench                                     # vanilla vs the shipped drafter, batch 1 and 4
  falcon-vllm bench --compile --batch-sizes 1 --pairs 20 --dataset humaneval
  falcon-vllm bench --configs vanilla,falcon,chain:2,eagle:2 --drafter <dir>

configurations: vanilla, falcon (the drafter's serving.json), chain[:K], lookup[:K[:F[:L[:N]]]], tree[:<tree>],
eagle[:K], ngram[:K], draft[:K] (vLLM's draft-model proposer; default model Qwen2.5-Coder-0.5B-Instruct);
<config>%key=value adds a speculative-config key, <config>@<dir> names another drafter (or draft model).
"""


def cli(argv: list[str]) -> int:
    if not os.path.exists(os.path.join(BENCH, "ab_step.py")):
        print("falcon-vllm: bench needs the repository checkout (benchmarks/ab_step.py); clone the repository and "
              "install it with `pip install -e .`", file=sys.stderr)
        return 2
    sys.path.insert(0, BENCH)  # the benchmarks and their harness live in the checkout, not in the package
    import ab_step

    given = {a.split("=")[0] for a in argv}
    # bench's own defaults, written out so the recorded command reruns it (only those the caller did not give)
    argv = [f"--{k}={v}" for k, v in DEFAULTS.items() if f"--{k}" not in given] + list(argv)
    sys.argv = [os.path.join(BENCH, "ab_step.py"), *argv]
    ab_step.main(argv, prog="falcon-vllm bench", description=DESCRIPTION, defaults=DEFAULTS)
    return 0
