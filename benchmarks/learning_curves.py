"""Learning curves of drafter training runs: held-out top-1 per block position and simulated tau
against steps (every epoch's evaluation) and, across runs on nested data subsets, against the number
of training conversations.

    python benchmarks/learning_curves.py --run falcon=<out dir> --run falcon-1k=<out dir> ... --name NAME

Each ``<out dir>`` is a ``falcon-vllm train --out`` directory (its ``training_log.json``).  Writes
``NAME.json``, ``NAME.md`` and ``NAME.png`` under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, help="label=train output directory")
    p.add_argument("--name", default="learning_curves")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    runs = {}
    for item in args.run:
        label, _, path = item.partition("=")
        with open(os.path.join(path, "training_log.json")) as f:
            log = json.load(f)
        training = json.load(open(os.path.join(path, "config.json")))["falcon"].get("extra", {}).get("training", {})
        runs[label] = {"history": log["history"], "final": log["final"], "training": training}
    os.makedirs(args.out_dir, exist_ok=True)
    cmd = "python benchmarks/learning_curves.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(os.path.join(args.out_dir, f"{args.name}.json"), "w") as f:
        json.dump({"command": cmd, "runs": runs}, f, indent=1)
    lines = [f"# Drafter learning curves ({args.name})", "", f"Command: `{cmd}`", "",
             "Held-out conversations (the last 1/16 of the data, never trained on). top-1: the drafter's argmax equals "
             "the target's greedy token, per position in the k-block; sim tau: mean tokens per step on the drafter's "
             "tree with true features (bonus included).", "",
             "| run | train conv. | draft vocab | steps | minutes | top-1 by block position | sim tau |", "|---|---|---|---|---|---|---|"]
    for label, r in runs.items():
        fin = r["final"]
        lines.append(f"| {label} | {fin.get('train_conversations')} | {r['training'].get('draft_vocab') or 'full'} | "
                     f"{fin.get('steps')} | {fin.get('seconds', 0) / 60:.0f} | "
                     f"{', '.join(f'{x:.3f}' for x in fin['top1_by_block_position'])} | {fin['sim_tau']:.3f} |")
    lines += ["", "Per epoch (held-out subset of roots):", ""]
    for label, r in runs.items():
        pts = ", ".join(f"{h['step']}: {h['sim_tau']:.2f} / {h['top1_by_block_position'][0]:.3f}" for h in r["history"])
        lines.append(f"- {label} (step: sim tau / top-1 pos 0): {pts}")
    with open(os.path.join(args.out_dir, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for label, r in runs.items():
        steps = [h["step"] for h in r["history"]]
        ax[0].plot(steps, [h["sim_tau"] for h in r["history"]], marker="o", label=label)
        ax[1].plot(steps, [h["top1_by_block_position"][0] for h in r["history"]], marker="o", label=f"{label} pos 0")
        if len(r["history"][0]["top1_by_block_position"]) > 1:
            ax[1].plot(steps, [h["top1_by_block_position"][-1] for h in r["history"]], ls="--",
                       label=f"{label} pos {len(r['history'][0]['top1_by_block_position']) - 1}")
    ax[0].set(xlabel="step", ylabel="held-out simulated tau", title="tau vs steps")
    ax[1].set(xlabel="step", ylabel="held-out top-1", title="top-1 vs steps")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, f"{args.name}.png"), dpi=110)


if __name__ == "__main__":
    main()
