"""Drafter data throughput: tokens/s of answering, of featurizing and of both, today's path against the states
captured inside vLLM (``gen-data --featurizer vllm``), same machine, same run.

Stages, each in its own process, one after the other (vLLM's CPU worker binds the process's OpenMP threads, so
no stage inherits another's binding), on the same ShareGPT first turns:

* ``today-answer``: vLLM answers (``gen-data --answers-only``, vLLM's ``auto`` thread binding, which keeps one of
  the cores for an engine-core process an in-process engine does not have), in the dtype the capture stages use
  (``--featurize-dtype``: bf16 where the CPU has native bf16, fp32 elsewhere);
* ``today-featurize``: those answers featurized by transformers in fp32 on every core (``gen-data --answers``);
* ``combined``: the capture engine answers and keeps the states in one pass (``--featurizer vllm``; bf16 where
  the CPU has native bf16; every core);
* ``prefill``: today's answers featurized by a prefill through the capture engine (``--answers`` with
  ``--featurizer vllm``); its states are compared with today-featurize's fp32 ones.

Engine start-up is not counted (it is once per run).  Featurized tokens are prompt + answer tokens.

  python benchmarks/data_throughput.py --target qwen2.5-coder-1.5b-instruct --num-conversations 32 \\
      --stages today-answer,today-featurize,combined,prefill,combined,today-featurize,today-answer \\
      --name data_throughput_qwen15
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from harness.machine import cpu_name
from harness.paths import RESULTS, portable
from harness.report import write_report

STAGES = ("today-answer", "today-featurize", "combined", "prefill")


def _prompts(args):
    from transformers import AutoTokenizer

    from falcon_vllm.train.gen_data import usable_prompts

    tok = AutoTokenizer.from_pretrained(args.target)
    return usable_prompts(tok, None, args.num_conversations, args.skip_conversations, 384)[0]


def _save(path, obj):
    import torch

    torch.save(obj, path)


def stage(args) -> dict:
    """Run one stage in this process; returns its figures (and leaves its outputs in ``args.work``): wall seconds
    and the process's CPU seconds (every thread) of the timed part."""
    import torch

    w = args.work
    if args.stage == "today-answer":
        from falcon_vllm.train.vllm_data import featurize_dtype
        from falcon_vllm.vllm.generate import VLLMGenerator

        prompts = _prompts(args)
        dtype = featurize_dtype(args.featurize_dtype)
        gen = VLLMGenerator(args.target, 512 + args.max_new_tokens, max_num_seqs=128, dtype=dtype)
        t0, c0 = time.perf_counter(), time.process_time()
        answers = gen(prompts, args.max_new_tokens)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        gen.close()
        _save(os.path.join(w, "seqs.pt"), [p + a for p, a in zip(prompts, answers)])
        return {"answer_tokens": sum(map(len, answers)), "tokens": sum(len(p) + len(a) for p, a in zip(prompts, answers)),
                "seconds": secs, "cpu_seconds": cpu, "dtype": dtype, "threads": "vLLM auto bind"}
    if args.stage == "today-featurize":
        from transformers import AutoModelForCausalLM

        from falcon_vllm.train.gen_data import featurize_batch

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        seqs = torch.load(os.path.join(w, "seqs.pt"))
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        t0, c0 = time.perf_counter(), time.process_time()
        out = featurize_batch(model, seqs, [[0] * len(s) for s in seqs])
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        _save(os.path.join(w, "hf_states.pt"), [s.features for s in out])
        return {"tokens": sum(map(len, seqs)), "seconds": secs, "cpu_seconds": cpu, "dtype": "float32",
                "threads": torch.get_num_threads()}
    from falcon_vllm.train.vllm_data import capture_features, featurize_dtype
    from falcon_vllm.vllm.capture import CaptureEngine

    dtype = featurize_dtype(args.featurize_dtype)
    eng = CaptureEngine(args.target, 512 + args.max_new_tokens, max_num_seqs=128, dtype=dtype)
    try:
        if args.stage == "combined":
            prompts = _prompts(args)
            t0, c0 = time.perf_counter(), time.process_time()
            answers = eng(prompts, args.max_new_tokens)
            seqs = [p + a for p, a in zip(prompts, answers)]
            feats, zero_last, _ = capture_features(eng, seqs, True)
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
            return {"answer_tokens": sum(map(len, answers)), "tokens": sum(map(len, seqs)), "seconds": secs, "cpu_seconds": cpu,
                    "dtype": dtype, "threads": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "last_row_zero": zero_last}
        seqs = torch.load(os.path.join(w, "seqs.pt"))
        t0, c0 = time.perf_counter(), time.process_time()
        feats, _, _ = capture_features(eng, seqs, False)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        eng.close()
    ref = torch.load(os.path.join(w, "hf_states.pt"))
    diff = torch.cat([(a.float() - b.float()).abs().flatten() for a, b in zip(feats, ref)])
    mag = torch.cat([b.float().abs().flatten() for b in ref])
    cos = torch.cat([torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1) for a, b in zip(feats, ref)])
    return {"tokens": sum(map(len, seqs)), "seconds": secs, "cpu_seconds": cpu, "dtype": dtype,
            "threads": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "vs_fp32": {"mean_abs_diff": diff.mean().item(), "mean_abs": mag.mean().item(),
                        "max_abs_diff": diff.max().item(), "min_cosine": cos.min().item(), "mean_cosine": cos.mean().item()}}


def _today(ta, tf, key):
    """Today's featurized tokens per second of ``key`` (wall or CPU): answering, then featurizing those tokens."""
    return ta["tokens"] / (ta[key] + tf[key] * ta["tokens"] / tf["tokens"])


def report(args, rows: dict, argv, runs: list[dict], load: float) -> None:
    cmd = "python benchmarks/data_throughput.py " + " ".join(shlex.quote(str(portable(a))) for a in argv)
    ta, tf, cb, pf = (rows.get(s) for s in STAGES)
    today = {k: _today(ta, tf, k) for k in ("seconds", "cpu_seconds")} if ta and tf else None
    table = [("answer (today: vLLM, auto bind)", ta, "answer"), ("featurize (today: transformers fp32)", tf, "feat"),
             ("answer, then featurize (today)", None, "today"),
             ("answer + featurize in one pass (states captured in vLLM)", cb, "feat"),
             ("featurize stored answers (prefill through vLLM)", pf, "feat")]
    cores = len(os.sched_getaffinity(0))
    lines = [f"# Drafter data throughput: {args.name}", "", f"Command: `{cmd}`", "",
             f"Machine: {cpu_name()} ({cores} cores to this run; 1-minute load average {load:.1f} before the first "
             "stage).  Target "
             f"{os.path.basename(os.path.normpath(args.target))}; {args.num_conversations} ShareGPT first turns "
             f"(after the first {args.skip_conversations}), greedy, up to {args.max_new_tokens} answer tokens; "
             "each stage in its own process, one after the other, in this order: " + ", ".join(r["stage"] for r in runs)
             + " (a stage run twice: its runs added up); engine start-up and model loading not counted.", "",
             "| stage | dtype | threads | tokens | answer tokens | wall s | CPU s | answer tok/s | featurized tok/s | "
             "featurized tokens per CPU-hour | vs today (wall / CPU time) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r, kind in table:
        if kind == "today":
            if today:
                lines.append(f"| {label} | | | | | | | | {today['seconds']:.1f} | "
                             f"{today['cpu_seconds'] * 3600:,.0f} | 1.00x / 1.00x |")
            continue
        if r is None:
            continue
        ans = f"{r['answer_tokens'] / r['seconds']:.1f}" if "answer_tokens" in r else ""
        feat, fcpu = (r["tokens"] / r["seconds"], r["tokens"] / r["cpu_seconds"]) if kind == "feat" else (None, None)
        vs = f"{feat / today['seconds']:.2f}x / {fcpu / today['cpu_seconds']:.2f}x" if feat and today else ""
        lines.append(f"| {label} | {r['dtype']} | {r['threads']} | {r['tokens']} | {r.get('answer_tokens', '')} | "
                     f"{r['seconds']:.1f} | {r['cpu_seconds']:.1f} | {ans} | {f'{feat:.1f}' if feat else ''} | "
                     f"{f'{fcpu * 3600:,.0f}' if feat else ''} | {vs} |")
    if pf and "vs_fp32" in pf:
        v = pf["vs_fp32"]
        lines += ["", f"States of the prefill through vLLM ({pf['dtype']}) against transformers' fp32 ones on the same "
                  f"{pf['tokens']} tokens (both stored as bf16): mean |diff| {v['mean_abs_diff']:.4f} "
                  f"(mean |state| {v['mean_abs']:.3f}), max |diff| {v['max_abs_diff']:.3f}; cosine per row mean "
                  f"{v['mean_cosine']:.5f}, min {v['min_cosine']:.5f}."]
    lines += ["", "Featurized tokens: prompt + answer tokens with their states.  Per CPU-hour: per hour of CPU time the "
              "stage's process used (every thread; it does not count a core that vLLM's auto binding leaves idle, so "
              "wall time on the whole machine is the fairer measure of what a run costs).  'vs today': against "
              "today's two stages together, answer then featurize, per featurized token.  The one-pass stage's last "
              "row of each conversation is zero (the answer's last token is never fed to the model; nothing reads "
              "that row)."]
    write_report(RESULTS, args.name, {"command": cmd, "machine": cpu_name(), "cores": cores, "stages": rows, "runs": runs,
                                      "today_featurized_tok_s": today}, lines)
    print("\n".join(lines))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True,
                   help="an offline model's name (qwen2.5-coder-1.5b-instruct: `make models-qwen`) or a target directory")
    p.add_argument("--num-conversations", type=int, default=32)
    p.add_argument("--skip-conversations", type=int, default=1296,
                   help="ShareGPT first turns to skip (default: past those the shipped Qwen answers hold)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--featurize-dtype", default="auto")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--name", default="data_throughput")
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from falcon_vllm.models import model_path

    args.target = str(model_path(args.target))  # a directory stays as given
    if args.stage:
        res = stage(args)
        with open(os.path.join(args.work, args.stage + ".json"), "w") as f:
            json.dump(res, f)
        return 0
    runs = []
    load = os.getloadavg()[0]  # other work on the machine slows every stage (the results page says how much ran)
    with tempfile.TemporaryDirectory() as work:
        for s in args.stages.split(","):
            print(f"== {s}", flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--stage", s, "--work", work],
                           check=True)
            with open(os.path.join(work, s + ".json")) as f:
                runs.append({"stage": s, **json.load(f)})
            print(runs[-1], flush=True)
    report(args, merge(runs), argv, runs, load)
    return 0


def merge(runs: list[dict]) -> dict:
    """Each stage's runs added up (tokens and seconds; a stage given twice in --stages, e.g. first and last, evens
    out a load that changes during the run)."""
    rows: dict = {}
    for r in runs:
        if r["stage"] not in rows:
            rows[r["stage"]] = {k: v for k, v in r.items() if k != "stage"}
            rows[r["stage"]]["runs"] = 1
            continue
        m = rows[r["stage"]]
        m["runs"] += 1
        for k in ("tokens", "answer_tokens", "seconds", "cpu_seconds", "last_row_zero"):
            if k in r:
                m[k] += r[k]
    return rows


if __name__ == "__main__":
    sys.exit(main())
