#!/usr/bin/env python
"""Study: What tau do the drafters reach in the reference engine (greedy, batch 1, no vLLM)?

Answer: Falcon 1.50 on falcon-llama (118 nodes) and 1.13 on a 4-token chain; EAGLE 1.46 on eagle-small and
1.24 on a 4-token chain; all greedy-identical.
Result: benchmarks/results/ref_tau_smollm2.md

tau of drafters in the reference engine (greedy, batch 1) on MT-Bench first turns.

    python benchmarks/studies/ref_tau.py --drafter falcon=<dir>:falcon-llama --drafter eagle=<dir>:eagle-small \\
        --num-prompts 6 --max-new-tokens 64 --name ref_tau_smollm2

Each ``--drafter`` is ``label=<drafter dir>:<tree>``: a Falcon-format drafter, or an EAGLE-1 drafter in
vLLM's ``method: "eagle"`` layout (run as the k=1 fc drafter it is).  Every output is checked to be
token-identical to transformers' greedy generate.  Writes ``benchmarks/results/<name>.{json,md}``.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness.paths import RESULTS  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", action="append", required=True, help="label=<dir>:<tree>")
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--name", default="ref_tau")
    p.add_argument("--out-dir", default=RESULTS)
    a = p.parse_args(argv)
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.models import chat_ids, load_chat_prompts, model_path
    from falcon_vllm.reference import FalconReferenceEngine
    from falcon_vllm.testing import hf_greedy

    path = a.model or str(model_path())
    tok = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = []
    for q in load_chat_prompts("mt-bench", a.num_prompts):
        prompts.append(chat_ids(tok, [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True))
    refs = [hf_greedy(target, pr, a.max_new_tokens) for pr in tqdm(prompts, desc="hf greedy")]
    rows = []
    for spec in a.drafter:
        label, rest = spec.split("=", 1)
        ddir, tree = rest.rsplit(":", 1)
        eng = FalconReferenceEngine(target, FalconDrafter.load(ddir, target.config), tree)
        acc, same, t0 = [], True, time.time()
        for pr, ref in tqdm(list(zip(prompts, refs)), desc=label):
            r = eng.generate(pr, a.max_new_tokens)
            acc += r.accept_lengths
            same &= r.tokens == ref
        tau_ex = sum(acc) / len(acc)
        rows.append({"label": label, "drafter": os.path.basename(ddir.rstrip("/")), "k": eng.k, "tree": tree,
                     "tree_nodes": eng.tree.num_nodes, "drafter_passes_per_step": eng.tree.num_passes,
                     "tau": round(1 + tau_ex, 3), "tau_excl_bonus": round(tau_ex, 3), "steps": len(acc),
                     "greedy_identical": same, "num_prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
                     "seconds": round(time.time() - t0, 1),
                     "command": " ".join([os.path.relpath(sys.argv[0])] + (argv or sys.argv[1:]))})
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, a.name + ".json"), "w") as f:
        json.dump(rows, f, indent=1)
    cols = ["label", "k", "tree", "tree_nodes", "drafter_passes_per_step", "tau", "tau_excl_bonus", "steps",
            "greedy_identical"]
    md = [f"# {a.name}", "", f"Command: `{rows[0]['command']}`", "",
          f"Reference engine (transformers target, batch 1, greedy), MT-Bench first turns: {len(prompts)} prompts x "
          f"{a.max_new_tokens} new tokens. tau includes the bonus token.", "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    with open(os.path.join(a.out_dir, a.name + ".md"), "w") as f:
        f.write("\n".join(md) + "\n")
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
