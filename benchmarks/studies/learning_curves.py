"""Study: How do held-out top-1 and simulated tau grow with training steps and data?

Answer: Each later training stage gained less held-out top-1 (+0.035, +0.037 with 46% more data, then +0.007);
the last curves are the fifth stage's.
Result: benchmarks/results/learning_curves_smollm2_v7.md

Learning curves of drafter training runs: held-out top-1 per block position and simulated tau
against steps (every epoch's evaluation) and, across runs on nested data subsets, against the number
of training conversations.

    python benchmarks/studies/learning_curves.py --run falcon=<out dir> --run falcon-1k=<out dir> ... --name NAME

Each ``<out dir>`` is a ``falcon-vllm train --out`` directory (its ``training_log.json``).  Writes
``NAME.json``, ``NAME.md`` and ``NAME.png`` under ``benchmarks/results/``.

Each run's own held-out set is the last 1/16 of *its* data, so runs on different data are scored on
different conversations.  ``--heldout DATA`` (gen-data directories, comma-separated, as given to
``train --data``) re-scores every run's final drafter on one set: the last 1/16 of DATA.  Pass the
largest run's data, so that no run has trained on those conversations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness.paths import RESULTS  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, help="label=train output directory")
    p.add_argument("--name", default="learning_curves")
    p.add_argument("--heldout", default=None, help="gen-data dirs: re-score every run on the last 1/16 of them")
    p.add_argument("--target", default=None, help="target HF dir of --heldout (default: SmolLM2-135M-Instruct)")
    p.add_argument("--eval-roots", type=int, default=240, help="tree roots for the simulated tau of --heldout")
    p.add_argument("--out-dir", default=RESULTS)
    args = p.parse_args(argv)
    runs = {}
    for item in args.run:
        label, _, path = item.partition("=")
        with open(os.path.join(path, "training_log.json")) as f:
            log = json.load(f)
        training = json.load(open(os.path.join(path, "config.json")))["falcon"].get("extra", {}).get("training", {})
        runs[label] = {"history": log["history"], "final": log["final"], "training": training}
    common = rescore(runs, args.run, args.heldout, args.eval_roots, args.target) if args.heldout else None
    os.makedirs(args.out_dir, exist_ok=True)
    cmd = "python benchmarks/studies/learning_curves.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(os.path.join(args.out_dir, f"{args.name}.json"), "w") as f:
        json.dump({"command": cmd, "runs": runs, "common_heldout": common}, f, indent=1)
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
    if common:
        lines += ["", f"Every final drafter on one held-out set ({common['conversations']} conversations, the last 1/16 "
                  f"of `{args.heldout}`; {args.eval_roots} tree roots):", "",
                  "| run | top-1 by block position | sim tau |", "|---|---|---|"]
        for label, ev in common["runs"].items():
            lines.append(f"| {label} | {', '.join(f'{x:.3f}' for x in ev['top1_by_block_position'])} | "
                         f"{ev['sim_tau']:.3f} |")
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


def rescore(runs: dict, items: list[str], heldout: str, eval_roots: int, target_dir: str | None) -> dict:
    """Each run's final drafter scored on the last 1/16 of ``heldout`` (the split ``train`` makes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.models import model_path
    from falcon_vllm.train.gen_data import load_shards
    from falcon_vllm.train.data import split_held_out
    from falcon_vllm.train.evaluation import evaluate
    from falcon_vllm.tree import build_tree

    _, val, _ = split_held_out(load_shards(heldout))
    target = AutoModelForCausalLM.from_pretrained(target_dir or str(model_path()), dtype=torch.float32).eval()
    out = {}
    for item in items:
        label, _, path = item.partition("=")
        drafter = FalconDrafter.from_pretrained(path, target.config)
        drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
        cfg = drafter.config
        with torch.no_grad():
            out[label] = evaluate(drafter, val, build_tree(cfg.tree, cfg.k), cfg.k,
                                  runs[label]["training"].get("max_len", 384), eval_roots)
        print(label, json.dumps(out[label]), flush=True)
    return {"conversations": len(val), "runs": out}


if __name__ == "__main__":
    main()
