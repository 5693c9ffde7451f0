"""Study: Which size N of the truncated draft vocabulary covers the answers at a small drafter-pass cost?

Answer: N = 8192 covers 0.900 of held-out answer tokens for a drafter pass of 0.133 target steps (the full
49152-token head: 0.416); the shipped drafters use it.
Result: benchmarks/results/draft_vocab_smollm2.md

Choose the truncated draft vocabulary N: coverage of answer tokens and drafter-pass cost.

Coverage: the N most frequent answer tokens of the training part of a gen-data set (the trainer's
split: the last 1/16 of the conversations is held out), measured on the held-out answers.
Cost: one drafter pass (k rows, 1 decoder layer, fusion, LM head over N) against one target decode
step (one token after a ``--context``-token KV cache), both timed in this process, interleaved, as
the median of ``--repeats`` runs (torch threads as given).

    python benchmarks/studies/draft_vocab.py --data <gen-data dir> --name draft_vocab_smollm2
    python benchmarks/studies/draft_vocab.py --answers <answers file> --target <dir> --name draft_vocab_qwen15

``--answers`` (a gen-data answers file, tokens only) serves where no featurized data exists yet: coverage
needs only the answer tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness.paths import RESULTS, portable  # noqa: E402

from falcon_vllm.config import FalconConfig  # noqa: E402
from falcon_vllm.drafter import FalconDrafter, chunk_mask  # noqa: E402
from falcon_vllm.train.gen_data import Sample, load_shards  # noqa: E402
from falcon_vllm.train.data import frequent_tokens, split_held_out, vocab_coverage  # noqa: E402


def answer_samples(path: str) -> list[Sample]:
    """The conversations of an answers file as samples without features (coverage needs only the tokens)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        t, m, off = f.get_tensor("tokens").long(), f.get_tensor("loss_mask").bool(), f.get_tensor("offsets").tolist()
    return [Sample(t[a:b], m[a:b], None) for a, b in zip(off[:-1], off[1:])]


def timed(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@torch.inference_mode()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="gen-data directory (comma-separated for several)")
    p.add_argument("--answers", default=None, help="instead of --data: a gen-data answers file (tokens only)")
    p.add_argument("--target", default=None, help="target HF dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--sizes", default="2048,4096,8192,16384,32768")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--name", default="draft_vocab")
    p.add_argument("--out-dir", default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, DynamicCache

    from falcon_vllm.models import model_path

    target = AutoModelForCausalLM.from_pretrained(args.target or str(model_path()), dtype=torch.float32).eval()
    V = target.config.vocab_size
    if (args.data is None) == (args.answers is None):
        raise SystemExit("draft_vocab: give one of --data and --answers")
    data = load_shards(args.data) if args.data else answer_samples(args.answers)
    train, held, _ = split_held_out(data)
    sizes = [int(s) for s in args.sizes.split(",")]

    # target decode step: one token after a context-long cache
    ids = torch.randint(0, V, (1, args.context))
    cache = DynamicCache(config=target.config)
    target(input_ids=ids, past_key_values=cache, use_cache=True)
    one = torch.randint(0, V, (1, 1))

    def target_step():
        target(input_ids=one, past_key_values=cache, use_cache=True)
        cache.crop(args.context)

    rows = []
    heads = [None] + sizes
    drafters = {}
    for n in heads:
        cfg = FalconConfig.from_target(target.config, k=args.k, fusion="fc", draft_vocab_size=n)
        d = FalconDrafter(cfg).eval()
        d.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
        if n:
            d.init_draft_head(frequent_tokens(train, n, V), target.get_output_embeddings().weight)
        drafters[n] = d
    H = target.config.hidden_size
    emb = torch.randn(1, args.k, H)
    feats = torch.randn(1, args.k, H)
    pos = torch.arange(args.context, args.context + args.k)[None]
    past = [(torch.randn(1, cfg.num_key_value_heads, args.context, cfg.head_dim),) * 2]
    mask = chunk_mask(args.context, args.k, args.k)

    def draft_pass(d):
        out, _ = d(emb, feats, pos, mask, past)
        d.topk_tokens(out[0], 4)

    t_target = []
    t_draft = {n: [] for n in heads}
    for _ in range(3):  # interleaved rounds: machine noise hits every row alike
        t_target.append(timed(target_step, args.repeats))
        for n in heads:
            t_draft[n].append(timed(lambda: draft_pass(drafters[n]), args.repeats))
    tt = statistics.median(t_target)
    for n in heads:
        td = statistics.median(t_draft[n])
        cov = 1.0 if n is None else vocab_coverage(held, frequent_tokens(train, n, V), V)
        rows.append({"draft_vocab": n or V, "heldout_coverage": round(cov, 4), "drafter_pass_ms": round(td * 1e3, 3),
                     "target_step_ms": round(tt * 1e3, 3), "pass_over_target_step": round(td / tt, 4)})
    res = {"command": "python benchmarks/studies/draft_vocab.py " + " ".join(str(portable(a)) for a in (
               argv if argv is not None else sys.argv[1:])),
           "train_conversations": len(train), "heldout_conversations": len(held), "threads": args.threads,
           "context": args.context, "k": args.k, "rows": rows}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{args.name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Draft vocabulary: coverage and drafter-pass cost ({args.name})", "",
             f"Command: `{res['command']}`", "",
             f"{'Answers file' if args.answers else 'gen-data'}: frequencies from {len(train)} training conversations, coverage of the answer tokens of "
             f"{len(held)} held-out ones. Cost: one drafter pass (k={args.k} rows, 1 layer, fc fusion, top-4 "
             f"over the head) against one target decode step after {args.context} tokens (HF, fp32, "
             f"{args.threads} thread(s), median of {args.repeats} x 3 interleaved rounds).", "",
             "| draft vocab | held-out coverage | drafter pass (ms) | target step (ms) | pass / target step |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['draft_vocab']} | {r['heldout_coverage']:.4f} | {r['drafter_pass_ms']:.2f} | "
              f"{r['target_step_ms']:.2f} | {r['pass_over_target_step']:.3f} |" for r in rows]
    with open(os.path.join(args.out_dir, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
