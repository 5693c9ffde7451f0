#!/usr/bin/env python
"""Drafters scored offline on the benchmark prompts: top-1 per block position and simulated tau.

    python benchmarks/heldout_eval.py --drafter falcon=falcon_vllm/drafters/smollm2-135m-instruct \\
        --drafter eagle=falcon_vllm/drafters/smollm2-135m-instruct-eagle --tree chain-2 --name heldout_eval
    # each on a tree of its own in one run: label:<tree>=<dir>
    python benchmarks/heldout_eval.py --drafter falcon=falcon_vllm/drafters/smollm2-135m-instruct --tree own \
        --drafter eagle:eagle-small=falcon_vllm/drafters/smollm2-135m-instruct-eagle --name heldout_eval_own

The target answers the first turn of the first ``--num-prompts`` prompts of each dataset greedily
(``falcon-vllm gen-data``: vLLM when installed, else transformers; cached in ``--work``, resumable),
and every drafter is scored on those answers with the target's true features, as ``falcon-vllm
train`` scores its held-out conversations: top-1 = the drafter's argmax equals the target's greedy
token, per position in the k-block; sim tau = mean tokens per step (bonus included) on ``--tree``
(or each drafter's own tree), roots every 3rd answer position.  These prompts are never trained on
(gen-data's training data is ShareGPT); ``--sharegpt DIR`` adds the held-out split (the last 1/16)
of a gen-data directory, less the conversations whose prompt a training one repeats (``split_held_out``).
No vLLM engine runs the drafters here, so the figures isolate the drafter from serving: compare with
``ab_step.py``'s steps per generation for what serving loses.
Writes ``benchmarks/results/<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from harness.paths import RESULTS, portable, portable_text
from harness.prompts import DATASETS, eval_set
from harness.report import write_report

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", action="append", required=True,
                   help="label=<drafter dir> (Falcon or vLLM EAGLE); label:<tree>=<dir> scores that drafter on its "
                        "own tree instead of --tree (e.g. Falcon and EAGLE, each on its tree, in one run)")
    p.add_argument("--datasets", default=",".join(DATASETS),
                   help="comma-separated: " + ", ".join(DATASETS) + ", mt-bench-turn2 (the second turns)")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tree", default="chain-2", help="tree for sim tau ('own': each drafter's default tree)")
    p.add_argument("--sharegpt", default=None, help="gen-data dir(s), comma-separated: add its held-out 1/16")
    p.add_argument("--roots", type=int, default=400, help="tree roots per dataset for sim tau")
    p.add_argument("--best-trees", default="",
                   help="node counts, e.g. 16: also the sim tau of each drafter's best tree of that size, fitted "
                        "to half of the roots and scored on the other half (acceptance.cross_fit_tau)")
    p.add_argument("--context", choices=["relaxed", "causal"], default="relaxed",
                   help="top-1 as training computes it (relaxed: every block sees its whole block) or as vLLM's "
                        "proposer does (causal: the positions before the block with causal K/V; differs only "
                        "for drafters of more than one layer)")
    p.add_argument("--work", default=".cache/heldout-eval")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default="heldout_eval")
    p.add_argument("--out-dir", default=RESULTS)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.models import model_path
    from falcon_vllm.train.gen_data import load_shards, stored_aux_layers, with_aux_states
    from falcon_vllm.train.data import split_held_out
    from falcon_vllm.train.evaluation import evaluate
    from falcon_vllm.tree import build_tree

    t0 = time.time()
    target_dir = a.model or str(model_path())
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    by_aux: dict = {}

    def sets_for(aux: tuple) -> dict:
        """The evaluation sets with the features a drafter reads (final-norm states, + those of ``aux``)."""
        if aux not in by_aux:
            with torch.inference_mode():
                sets = {d: eval_set(d, a.num_prompts, a.max_new_tokens, a.work, target_dir, target, aux)
                        for d in a.datasets.split(",") if d}
                if a.sharegpt:  # the trainer's held-out conversations (less those whose prompt it trained on)
                    stored = all(h == list(aux) for h in stored_aux_layers(a.sharegpt))
                    _, held, left_out = split_held_out(load_shards(a.sharegpt, aux=stored and bool(aux)))
                    sets["sharegpt-heldout"] = held if stored or not aux else with_aux_states(target, held, aux)
                    print(f"sharegpt-heldout: {len(held)} conversations ({left_out} left out: a training "
                          "conversation has their prompt)", flush=True)
            by_aux[aux] = sets
        return by_aux[aux]

    rows = []
    widths = [int(w) for w in a.best_trees.split(",") if w]
    drafters = []  # every drafter and its tree first: a bad one stops the run before any evaluation
    for item in a.drafter:
        head, _, path = item.partition("=")
        label, _, own_tree = head.partition(":")
        if not path or not label:
            raise SystemExit(f"heldout_eval: --drafter takes label=<dir> or label:<tree>=<dir>, got {item!r}")
        d = FalconDrafter.load(path, target.config)  # ours, or vLLM's EAGLE layout (the k=1 fc drafter it is)
        tree = own_tree or (d.config.tree if a.tree == "own" else a.tree)
        if tree is None:
            raise SystemExit(f"heldout_eval: --tree own: drafter {path} names no tree of its own (vLLM's EAGLE "
                             "layout does not): give it one (--drafter <label>:<tree>=<dir>, e.g. "
                             "eagle:chain-2=<dir>) or run with --tree <preset>")
        drafters.append((label, path, d, tree, build_tree(tree, d.config.k)))
    for label, path, d, tree, built in drafters:
        d.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
        sets = sets_for(d.config.aux_layers)
        for name, samples in sets.items():
            with torch.no_grad():
                r = evaluate(d, samples, built, d.config.k, 384, a.roots, widths,
                             context=a.context)
            row = {"drafter": label, "dir": portable(path), "k": d.config.k, "layers": d.config.num_layers,
                   "block_order": d.config.block_order, "aux_layers": list(d.config.aux_layers), "dataset": name,
                   "conversations": len(samples), "tree": tree, "context": a.context, **r}
            rows.append(row)
            print(json.dumps(row), flush=True)
    res = {"command": portable_text("python benchmarks/heldout_eval.py "
                                   + " ".join(argv if argv is not None else sys.argv[1:])),
           "num_prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens, "seconds": round(time.time() - t0, 1),
           "rows": rows}
    names = list(sets)
    lines = [f"# Drafters on held-out prompts: {a.name}", "", f"Command: `{res['command']}`", "",
             f"The target's greedy answers (first turn; mt-bench-turn2: the second, after its own first; at most "
             f"{a.max_new_tokens} tokens) to the first "
             f"{a.num_prompts} prompts of each dataset; the drafters read the target's true features. top-1: the "
             "drafter's argmax equals the target's token, per block position; sim tau: mean tokens per step on the "
             "tree (bonus included)" + ("; top-1 with the positions before each block attending causally, as vLLM's "
                                        "proposer runs a drafter (--context causal)" if a.context == "causal" else "")
             + ". Cells: top-1 by block position / sim tau"
             + (" / sim tau of the drafter's best tree of " + ", ".join(map(str, widths)) + " nodes (fitted to half of "
                "the roots with 8 tokens after them, scored on the other half)" if widths else "") + ".", "",
             "| drafter | tree | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for label in dict.fromkeys(r["drafter"] for r in rows):
        mine = {r["dataset"]: r for r in rows if r["drafter"] == label}
        cells = [", ".join(f"{x:.3f}" for x in mine[n]["top1_by_block_position"]) + f" / {mine[n]['sim_tau']:.3f}"
                 + "".join(f" / {t:.3f}" for t in mine[n].get("best_tree_sim_tau", {}).values()) for n in names]
        lines.append(f"| {label} | {mine[names[0]]['tree']} | " + " | ".join(cells) + " |")
    write_report(a.out_dir, a.name, res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
