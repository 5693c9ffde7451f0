"""``falcon-vllm bench``: runs ``benchmarks/bench_e2e.py`` (same flags; see its ``--help``)."""

import os
import runpy
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "bench_e2e.py")


def cli(argv):
    if not os.path.exists(SCRIPT):
        print("falcon-vllm bench needs the repository checkout (benchmarks/bench_e2e.py); "
              "install with `pip install -e .`", file=sys.stderr)
        return 2
    sys.argv = [SCRIPT] + list(argv)
    runpy.run_path(SCRIPT, run_name="__main__")
    return 0
