"""Study: Is a drafter held back by its data or by its capacity?

Answer: by its data. The shipped Qwen2.5-Coder-1.5B drafter (v2) predicts the target's next token (top-1 at block
position 0) on the conversations it trained on longest far better than on the same kind it never saw: 0.51 on
the first 60 ShareGPT conversations of its data (8 epochs, in both stages), 0.41 on the last 60 (3 epochs, the
second stage only), 0.35 on its held-out split and on 256 first turns that it never trained on. A drafter
limited by its capacity would score about the same on all of them.
Result: benchmarks/results/fit_gap_qwen15_v2.md

Each set is ``label=DIR:PART``: conversations of a gen-data directory, with PART ``heldout`` (its held-out split,
``split_held_out``, as the trainer makes it), ``train[A:B]`` (a slice of its training split) or ``[A:B]`` (a slice
of all its conversations).  Scored as the trainer scores its held-out set (``evaluate``) on the target's stored
states; only the target's embedding and LM head are loaded.

    python benchmarks/studies/fit_gap.py --drafter falcon_vllm/drafters/qwen2.5-coder-1.5b-instruct \\
        --model <qwen2.5-coder-1.5b-instruct-float32 dir> \\
        --set heldout=<work>/data/qwen15:heldout --set trained-first=<work>/data/qwen15:train[:60] \\
        --set unseen=<work>/data/qwen15-sharegpt-from1296:[:256] --name fit_gap_qwen15_v2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness.machine import cpu_name  # noqa: E402
from harness.paths import RESULTS, portable, portable_text  # noqa: E402
from harness.report import write_report  # noqa: E402

SET = re.compile(r"^([^=]+)=(.+):(heldout|train\[(-?\d*):(-?\d*)\]|\[(-?\d*):(-?\d*)\])$")


def target_head(target_dir: str):
    """The target's config, input embedding and LM head, read from its safetensors alone (not the whole model)."""
    from transformers import AutoConfig

    from falcon_vllm.drafter import EMBED_KEYS, HEAD_KEYS, target_tensor

    cfg = AutoConfig.from_pretrained(target_dir)
    key, head = target_tensor(target_dir, HEAD_KEYS)
    head = head.float()
    emb = head if key in EMBED_KEYS else target_tensor(target_dir, EMBED_KEYS)[1].float()  # tied: read once
    lm_head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False)
    lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    return cfg, torch.nn.Embedding.from_pretrained(emb), lm_head


def conversations(spec: str) -> tuple[str, str, str, list]:
    """(label, directory, part, samples) of one ``--set``."""
    from falcon_vllm.train.data import split_held_out
    from falcon_vllm.train.gen_data import load_shards

    m = SET.match(spec)
    if not m:
        raise SystemExit(f"fit_gap: --set takes label=DIR:heldout, label=DIR:train[A:B] or label=DIR:[A:B], got {spec!r}")
    label, d, part = m[1], m[2], m[3]
    data = load_shards(d, aux=False)
    if part == "heldout":
        return label, d, part, split_held_out(data)[1]
    a, b = (m[4], m[5]) if part.startswith("train") else (m[6], m[7])
    pool = split_held_out(data)[0] if part.startswith("train") else data
    return label, d, part, pool[int(a) if a else None:int(b) if b else None]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True)
    p.add_argument("--model", required=True, help="the target's directory (its embedding and LM head are read)")
    p.add_argument("--set", action="append", required=True, help="label=DIR:PART (see above)")
    p.add_argument("--tree", default="chain-2", help="the tree of the simulated tau")
    p.add_argument("--roots", type=int, default=60, help="tree roots per set for the simulated tau")
    p.add_argument("--name", default="fit_gap")
    p.add_argument("--out-dir", default=RESULTS)
    a = p.parse_args(argv)
    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.train.evaluation import evaluate
    from falcon_vllm.tree import build_tree

    cfg, embed, head = target_head(a.model)
    drafter = FalconDrafter.load(a.drafter, cfg).attach_target(embed, head)
    tree = build_tree(a.tree, drafter.config.k)
    rows = []
    for spec in a.set:
        label, d, part, samples = conversations(spec)
        t0 = time.time()
        r = evaluate(drafter, samples, tree, drafter.config.k, 384, a.roots)
        rows.append({"set": label, "dir": portable(d), "part": part,
                     "conversations": len(samples), "answer_tokens": sum(int(s.loss_mask.sum()) for s in samples),
                     "top1_by_block_position": r["top1_by_block_position"], "sim_tau": r["sim_tau"],
                     "sim_tau_se": r["sim_tau_se"], "seconds": round(time.time() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    command = portable_text("python benchmarks/studies/fit_gap.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    lines = [f"# Top-1 where the drafter trained and where it did not: {a.name}", "",
             f"Command: `{command}`", "",
             f"Machine: {cpu_name()}. Drafter `{portable(a.drafter)}`; top-1 at each block position over every answer "
             f"position (the target's greedy token), simulated tau on `{a.tree}` over {a.roots} roots per set.", "",
             "| set | conversations | part | answer tokens | top-1 (block positions 0, 1) | sim tau |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['set']} | {r['conversations']} | {r['dir']}: {r['part']} | {r['answer_tokens']:,} | "
              f"{', '.join(f'{x:.3f}' for x in r['top1_by_block_position'])} | {r['sim_tau']:.2f} ± {r['sim_tau_se']:.2f} |"
              for r in rows]
    write_report(a.out_dir, a.name, {"command": command, "machine": cpu_name(), "drafter": portable(a.drafter),
                                     "tree": a.tree, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
