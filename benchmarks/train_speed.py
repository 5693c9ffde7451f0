#!/usr/bin/env python
"""Drafter training speed: seconds per optimisation step of the real trainer (``falcon_vllm.train.trainer.train``)
on synthetic data shaped like a recipe's, on the CPU or a CUDA GPU.  Self-contained: no vLLM, no model
weights, no gen-data (a random-weight target with the recipe target's shapes, random tokens and features).

    python benchmarks/train_speed.py --device cpu --steps 6 --threads 2 --out /tmp/ts_cpu.json
    python benchmarks/train_speed.py --device cuda --bf16 --steps 50 --out /tmp/ts_cuda_bf16.json
    python benchmarks/train_speed.py --mode eagle --device cuda --bf16 --steps 50 --out /tmp/ts_cuda_eagle.json
    python benchmarks/train_speed.py --recipe qwen2.5-coder-1.5b --bf16 --steps 8 --out /tmp/ts_qwen_bf16.json

Settings (``--recipe``, default smollm2): the recipe's Falcon stage as ``train --recipe`` runs it at its last
stage's lr (smollm2: k=2, fc fusion, 2 layers, reversed block order, draft vocab 8192; qwen2.5-coder-1.5b: 1 layer
with its MLP narrowed to 3,584, frozen 16,384-token head), batch 8, teacher top-64; ``--mode eagle``: its EAGLE-1
baseline (k=1, fc, 1 layer, no glancing, tree eagle-small).  Conversations: smollm2's a prompt of 64-128 context
tokens (the trainer keeps 128) and a 136-160-token answer (loss mask), qwen2.5-coder-1.5b's 40-128 and 120-256;
features N(0, 2^2) in bf16; by default just enough of them that
every step falls in one epoch (an epoch end writes a checkpoint).  A step's time is the interval between the
ends of consecutive ``train_step`` calls (batch assembly and host-to-device copy included; CUDA synchronized),
the first ``--warmup`` steps excluded.  Set-up (target, samples, teacher cache, drafter) and the final held-out
eval + save are timed apart.  Writes ``--out`` (JSON) and the same name with ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

from harness.machine import cpu_name

from falcon_vllm.train import data, recipes, trainer
from falcon_vllm.train.gen_data import Sample

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
               rms_norm_eps=1e-5)
# Qwen2.5-Coder-1.5B-Instruct's shapes with one decoder layer: the trainer reads only the target's config, embeddings
# and LM head
QWEN15 = dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=1, num_attention_heads=12, num_key_value_heads=2,
              intermediate_size=8960, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768,
              rms_norm_eps=1e-6)
# per recipe: the target's shapes and its model class, and the conversations' prompt and answer lengths (the answers
# up to the recipe's max_new_tokens)
SHAPES = {"smollm2": (SMOLLM2, "llama", (64, 128), (136, 160)),
          "qwen2.5-coder-1.5b": (QWEN15, "qwen2", (40, 128), (120, 256))}


def recipe_settings(name: str, mode: str) -> dict:
    """The recipe's TrainConfig settings of its Falcon stage or EAGLE-1 baseline, as run_recipe passes them (its last
    stage's lr)."""
    r = recipes.RECIPES[name]
    return dict(r.get("train", {}), lr=r["continue"][-1]["lr"], batch_size=r["batch_size"],
                **recipes.drafter_settings(r, mode))


def build_target(args):
    if args.target_dir:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32).eval()
    if args.tiny:
        from falcon_vllm.testing import tiny_llama
        return tiny_llama(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, inter=128)
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shapes, kind = SHAPES[args.recipe][:2]  # the trainer uses its config, embeddings and LM head
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shapes)).float().eval()
    return LlamaForCausalLM(LlamaConfig(**shapes)).float().eval()


def make_samples(n: int, vocab: int, hidden: int, seed: int = 0, feature_std: float = 2.0,
                 fixed_length: bool = False, prompt=(64, 128), answer=(136, 160)) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        a = int(torch.randint(answer[0], answer[1] + 1, (1,), generator=g))
        if fixed_length:  # every batch the same shape (tells per-shape set-up costs from per-step costs)
            p, a = prompt[1], answer[1]
        mask = torch.zeros(p + a, dtype=torch.bool)
        mask[p:] = True
        feats = (torch.randn(p + a, hidden, generator=g) * feature_std).to(torch.bfloat16)
        out.append(Sample(torch.randint(0, vocab, (p + a,), generator=g), mask, feats))
    return out


def default_conversations(steps: int, batch: int) -> int:
    """Conversations whose training part (the trainer holds out 1/16) is max(``steps``, 60 / batch) full batches:
    every step in one epoch (an epoch end writes a checkpoint), no short batch."""
    want = batch * max(steps, math.ceil(60 / batch))
    return next(n for n in range(want, 2 * want + 2) if n - max(1, n // 16) == want)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return cpu_name()


def run(args) -> dict:
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("falcon-vllm: --device cuda but torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sdp != "default":  # which scaled_dot_product_attention kernels torch may pick (the drafter's attention)
        for kind in ("cudnn", "flash", "mem_efficient", "math"):
            getattr(torch.backends.cuda, f"enable_{kind}_sdp")(kind != "cudnn" if args.sdp == "no-cudnn"
                                                              else kind == args.sdp)
    total = args.warmup + args.steps
    t0 = time.perf_counter()
    target = build_target(args)
    t_target = time.perf_counter() - t0
    V, H = target.config.vocab_size, target.config.hidden_size
    n = args.conversations or default_conversations(total, args.batch_size)
    t0 = time.perf_counter()
    prompt, answer = SHAPES[args.recipe][2:]
    samples = make_samples(n, V, H, fixed_length=args.fixed_length, prompt=prompt, answer=answer)
    t_samples = time.perf_counter() - t0
    draft_vocab = min(recipes.RECIPES[args.recipe]["draft_vocab"], V // 2)
    rec = {"t_teacher": 0.0, "ends": [], "starts": [], "epochs": [], "losses": [], "positions": [], "answer": [],
           "convs": []}
    step, cache = trainer.train_step, data.teacher_cache

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed_cache(*a, **kw):
        t = time.perf_counter()
        c = cache(*a, **kw)
        sync()
        rec["t_teacher"] += time.perf_counter() - t
        return c

    def timed_step(drafter, net, opt, sched, batch, epoch, *a, **kw):
        sync()
        rec["starts"].append(time.perf_counter())
        out = step(drafter, net, opt, sched, batch, epoch, *a, **kw)
        sync()
        rec["ends"].append(time.perf_counter())
        rec["epochs"].append(epoch)
        rec["losses"].append(out["loss"])
        rec["positions"].append(int(batch["lengths"].sum()))
        rec["answer"].append(int(batch["loss"].sum()))
        rec["convs"].append(int(batch["lengths"].numel()))
        return out

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix="train-speed-") as tmp:
        cfg = trainer.TrainConfig(os.path.join(tmp, "drafter"), **{
            **recipe_settings(args.recipe, args.mode), "batch_size": args.batch_size, "epochs": 2, "max_steps": total,
            "teacher_topk": 64, "draft_vocab": draft_vocab, "bf16": args.bf16, "device": args.device,
            "eval_every_epoch": False, "resume": False, "eval_roots": args.eval_roots,
            "logit_positions": args.logit_positions or None})
        trainer.train_step, data.teacher_cache = timed_step, timed_cache
        try:
            t_train = time.perf_counter()
            res = trainer.train(cfg, samples=samples, target=target, log=lambda s: None)
            sync()
            t_done = time.perf_counter()
        finally:
            trainer.train_step, data.teacher_cache = step, cache
    w = args.warmup
    dts = [b - a for a, b in zip(rec["ends"][w - 1:-1], rec["ends"][w:])]
    inside = [b - a for a, b in zip(rec["starts"][w:], rec["ends"][w:])]
    s_step = sum(dts) / len(dts)
    return {
        "command": "python benchmarks/train_speed.py " + " ".join(args.argv), "mode": args.mode,
        "device": args.device, "device_name": device_name(args.device), "bf16": args.bf16,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "target": args.target_dir or
        ("tiny" if args.tiny else f"random {args.recipe} shapes"), "recipe": args.recipe, "vocab": V, "hidden": H,
        "draft_vocab": draft_vocab, "batch_size": args.batch_size, "conversations": n,
        "train_conversations": res["final"]["train_conversations"], "warmup_steps": w, "timed_steps": len(dts),
        "setup_s": {"target": round(t_target, 3), "samples": round(t_samples, 3),
                    "teacher_cache": round(rec["t_teacher"], 3),
                    "train_to_first_step": round(rec["starts"][0] - t_train, 3)},
        "warmup_s": round(rec["ends"][w - 1] - rec["starts"][0], 3),
        "step_s": [round(x, 4) for x in dts], "s_per_step": round(s_step, 4),
        "s_per_step_min": round(min(dts), 4), "s_per_step_median": round(sorted(dts)[len(dts) // 2], 4),
        "sdp": args.sdp, "fixed_length": args.fixed_length, "logit_positions": args.logit_positions,
        "s_in_train_step": round(sum(inside) / len(inside), 4),
        "steps_per_s": round(1 / s_step, 3),
        "conversations_per_s": round(sum(rec["convs"][w:]) / sum(dts), 2),
        "positions_per_s": round(sum(rec["positions"][w:]) / sum(dts), 1),
        "answer_tokens_per_s": round(sum(rec["answer"][w:]) / sum(dts), 1),
        "epoch_ends_in_timed_steps": sum(a != b for a, b in zip(rec["epochs"][w - 1:-1], rec["epochs"][w:])),
        "losses": [round(x, 4) for x in rec["losses"]], "final_eval_and_save_s": round(t_done - rec["ends"][-1], 3),
        "total_s": round(t_done - t_train + t_target + t_samples, 2),
        "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 3) if cuda else None,
        "final": res["final"]}


def lengths(r: dict) -> str:
    """The conversations' lengths in tokens (prompt + answer)."""
    prompt, answer = SHAPES[r.get("recipe", "smollm2")][2:]
    if r["fixed_length"]:
        return f"all {prompt[1] + answer[1]}"
    return f"{prompt[0] + answer[0]}-{prompt[1] + answer[1]}"


def markdown(r: dict) -> str:
    s = r["setup_s"]
    rows = [("device", f"{r['device_name']} ({r['device']}{', bf16 autocast' if r['bf16'] else ', fp32'})"),
            ("torch / threads", f"{r['torch']} / {r['threads']}"), ("mode", r["mode"]),
            ("set-up", f"target {s['target']:.1f} s, samples {s['samples']:.1f} s, train() to step 1 "
                       f"{s['train_to_first_step']:.1f} s (teacher cache {s['teacher_cache']:.1f} s of it)"),
            ("warm-up steps", f"{r['warmup_steps']} ({r['warmup_s']:.2f} s)"),
            ("s/step (mean, median, min)", f"{r['s_per_step']:.4f}, {r['s_per_step_median']:.4f}, "
                                           f"{r['s_per_step_min']:.4f} over {r['timed_steps']} steps"),
            ("attention kernels, lengths", f"sdp {r['sdp']}, {lengths(r)}"),
            ("LM-head rows per batch", r["logit_positions"] or "all loss positions"),
            ("steps/s", f"{r['steps_per_s']:.3f}"), ("conversations/s", f"{r['conversations_per_s']:.2f}"),
            ("tokens/s (positions, answer tokens)", f"{r['positions_per_s']:.0f}, {r['answer_tokens_per_s']:.0f}"),
            ("peak GPU memory", "-" if r["peak_gpu_mem_gib"] is None else f"{r['peak_gpu_mem_gib']:.2f} GiB"),
            ("final eval + save", f"{r['final_eval_and_save_s']:.1f} s")]
    return "\n".join([f"# Drafter training speed ({r['mode']}, {r['device']})", "", f"Command: `{r['command']}`", "",
                      "| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (the trainer's --bf16)")
    p.add_argument("--steps", type=int, default=6, help="timed optimisation steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3, 
                   help="first steps run but not timed (>= 1: the first includes lazy initialisation)")
    p.add_argument("--recipe", choices=sorted(SHAPES), default="smollm2",
                   help="whose drafter, data lengths and target shapes (random weights; `train --recipe`'s settings)")
    p.add_argument("--mode", choices=["eagle", "falcon"], default="falcon",
                   help="falcon: the recipe's Falcon stage; eagle: its EAGLE-1 baseline")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--conversations", type=int, default=None,
                   help="synthetic conversations, 1/16 held out (default: all steps in one epoch, full batches, "
                        ">= 60 trained on)")
    p.add_argument("--batch-size", type=int, default=8, help="conversations per step (both recipes': 8)")
    p.add_argument("--eval-roots", type=int, default=8, help="tree roots of the trainer's final held-out eval")
    p.add_argument("--target-dir", default=None, help="load this HF target dir instead of the recipe's random shapes")
    p.add_argument("--tiny", action="store_true", help="a tiny random target (vocab 512, hidden 64): for tests")
    p.add_argument("--sdp", default="default", choices=["default", "no-cudnn", "flash", "mem_efficient", "math"],
                   help="CUDA: which scaled_dot_product_attention kernels torch may use "
                        "(default: the trainer's own choice, all but cuDNN's)")
    p.add_argument("--logit-positions", type=int, default=trainer.TrainConfig.logit_positions,
                   help="LM-head rows per batch for the token losses (the trainer's flag; 0 = all loss positions)")
    p.add_argument("--fixed-length", action="store_true",
                   help="every conversation the longest prompt and answer (smollm2: 128 + 160; default: random "
                        "lengths, smollm2 64-128 + 136-160, qwen2.5-coder-1.5b 40-128 + 120-256): one batch shape")
    p.add_argument("--out", default=None, help="JSON result path (a .md is written next to it)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.steps < 1 or args.warmup < 1:
        p.error("falcon-vllm: --steps and --warmup must be >= 1")
    r = run(args)
    md = markdown(r)
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(md)
    return r


if __name__ == "__main__":
    main()
