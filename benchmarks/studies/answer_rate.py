"""Study: At which batch size and dtype does vLLM answer gen-data's prompts fastest on this CPU?

Answer: bf16 at batch 16-48: 41-46 answer tokens/s on Qwen2.5-Coder-1.5B-Instruct, 1.7-1.8x fp32 (25-26); batch 1: 3.7 (fp32), 6.7 (bf16).
Result: benchmarks/results/answer_rate_qwen15.md

Answer tokens per second of an in-process vLLM engine (``falcon_vllm.vllm.generate.VLLMGenerator``'s settings)
answering B ShareGPT first turns greedily, every answer run to ``--tokens`` tokens (EOS ignored, so every
batch size does the same work per request), per dtype.  gen-data's batch is its shard: ``--shard-size``.

  python benchmarks/studies/answer_rate.py --target <dir> --batch-sizes 1,16,64 --dtypes float32,bfloat16 \\
      --name answer_rate_qwen15
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness.machine import cpu_name  # noqa: E402
from harness.paths import RESULTS, portable  # noqa: E402
from harness.report import write_report  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", type=int, default=32, help="answer tokens per request")
    p.add_argument("--name", default="answer_rate")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from falcon_vllm.train.gen_data import usable_prompts
    from falcon_vllm.vllm.generate import VLLMGenerator

    bs = [int(b) for b in args.batch_sizes.split(",")]
    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = usable_prompts(tok, None, max(bs), 8192, 384)[0]  # past the SmolLM2 data's conversations
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    rows = []
    for dtype in args.dtypes.split(","):
        gen = VLLMGenerator(args.target, 512 + args.tokens, max_num_seqs=max(bs), dtype=dtype)
        try:
            gen.llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
            for b in bs:
                t0 = time.perf_counter()
                outs = gen.llm.generate([{"prompt_token_ids": q} for q in prompts[:b]], params, use_tqdm=False)
                secs = time.perf_counter() - t0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                rows.append({"dtype": dtype, "batch_size": b, "answer_tokens": n, "seconds": round(secs, 2),
                             "answer_tok_s": round(n / secs, 2)})
                print(rows[-1], flush=True)
        finally:
            gen.close()
    cmd = "python benchmarks/studies/answer_rate.py " + " ".join(shlex.quote(str(portable(a)))
                                                               for a in (argv or sys.argv[1:]))
    result = {"command": cmd, "machine": cpu_name(), "target": os.path.basename(os.path.normpath(args.target)),
              "tokens": args.tokens, "rows": rows}
    lines = [f"# vLLM answer rate against batch size and dtype: {args.name}", "", f"Command: `{cmd}`", "",
             f"Machine: {result['machine']}.  Target {result['target']}, greedy, {args.tokens} tokens per answer "
             "(EOS ignored), prompts of the whole batch submitted at once (continuous batching), prefill included.",
             "", "| dtype | batch | answer tokens | seconds | answer tokens/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['batch_size']} | {r['answer_tokens']} | {r['seconds']:.1f} | "
              f"{r['answer_tok_s']:.1f} |" for r in rows]
    write_report(RESULTS, args.name, result, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
