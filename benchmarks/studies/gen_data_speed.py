"""Study: Does gen-data answer faster through vLLM than through HF generate?

Answer: Yes: answering 2.2x faster on the same 16 conversations, identical answers.
Result: benchmarks/results/gen_data_speed_smollm2.md

gen-data throughput: answers by vLLM (continuous batching) against HF ``generate``, same conversations,
same process, back to back; the hidden states come from the same batched prefill in both.

    python benchmarks/studies/gen_data_speed.py --num-conversations 32 --name gen_data_speed_smollm2

Reports answer tokens per second of answering alone and of answering + featurizing, per backend, and
checks that both backends wrote the same answers (greedy; batched fp32 numerics may flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness.paths import RESULTS  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-conversations", type=int, default=32)
    p.add_argument("--skip-conversations", type=int, default=8192,
                   help="take conversations from here on (away from the ones used for training)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--name", default="gen_data_speed")
    p.add_argument("--out-dir", default=RESULTS)
    args = p.parse_args(argv)
    from falcon_vllm.models import model_path
    from falcon_vllm.train import gen_data

    target = str(model_path())
    rows, answers = [], {}
    for backend in ("vllm", "hf"):
        out = tempfile.mkdtemp(prefix=f"gen-{backend}-")
        gen_data.run(target, out, args.num_conversations, args.max_new_tokens, batch_size=args.hf_batch_size,
                     shard_size=args.num_conversations, backend=backend, skip_conversations=args.skip_conversations)
        man = json.load(open(os.path.join(out, "manifest.json")))
        sh = man["shards"][0]
        rows.append({"backend": backend, "conversations": sh["conversations"], "answer_tokens": sh["answer_tokens"],
                     "generate_s": sh["generate_s"], "featurize_s": sh["featurize_s"],
                     "answer_tok_s_generate": round(sh["answer_tokens"] / sh["generate_s"], 1),
                     "answer_tok_s_total": round(sh["answer_tokens"] / (sh["generate_s"] + sh["featurize_s"]), 1)})
        answers[backend] = [s.tokens.tolist() for s in gen_data.load_shards(out)]
    same = sum(a == b for a, b in zip(answers["vllm"], answers["hf"]))
    res = {"command": "python benchmarks/studies/gen_data_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "rows": rows, "identical_conversations": same, "conversations": len(answers["vllm"])}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{args.name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    ratio = rows[0]["answer_tok_s_total"] / rows[1]["answer_tok_s_total"]
    lines = [f"# gen-data throughput: vLLM vs HF generate ({args.name})", "", f"Command: `{res['command']}`", "",
             f"Same {args.num_conversations} ShareGPT first turns (from conversation {args.skip_conversations} on), "
             f"up to {args.max_new_tokens} greedy answer tokens, fp32; features from the same batched prefill.", "",
             "| backend | answer tokens | answering (s) | featurizing (s) | answer tok/s (answering) | answer tok/s (total) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['backend']} | {r['answer_tokens']} | {r['generate_s']:.1f} | {r['featurize_s']:.1f} | "
              f"{r['answer_tok_s_generate']:.1f} | {r['answer_tok_s_total']:.1f} |" for r in rows]
    lines += ["", f"vLLM / HF, total: {ratio:.2f}x. Identical answers: {same} of {len(answers['vllm'])} conversations."]
    with open(os.path.join(args.out_dir, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
