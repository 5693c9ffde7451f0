#!/usr/bin/env python
"""Per-component cost of one decoding step in vLLM: vanilla vs falcon chain vs falcon tree.

Each configuration runs in an in-process engine (eager, or compiled with --compile; fp32, prefix caching
off) over the first B MT-Bench questions (B = --batch-sizes, submitted together, --max-new-tokens each,
EOS ignored), after one untimed warm-up.  Wall-clock timers wrap (inclusive times, summed over the timed generations):

  step            LLMEngine.step (scheduler, model runner, output processing): the whole step
  target forward  the runner's _model_forward (the target's layers, attention included)
  attention       the target's attention backend forward (stock kernel and/or tree path), per layer
  tree attention  the tree path of the target's attention (falcon_vllm.vllm.tree_verify.VerifyTreeAttention)
  lm head         the target's compute_logits
  sampler         the runner's _sample (vLLM's sampler / rejection sampler, or the tree sampler)
  compaction      tree mode's K/V + buffer compaction (inside the sampler)
  drafting        the runner's propose_draft_token_ids (vLLM's drafter input preparation + the proposer)
  drafter passes  the Falcon/EAGLE proposer's propose (the drafter's forward passes, in its own layers)
  bookkeeping     step - target forward - lm head - sampler - drafting (scheduling, input preparation,
                  output processing: everything vLLM does around the model)

Reported per step (ms) and as a share of the step.  ``--compare DIR`` runs the same configurations
with the code of another checkout of this repository (its directory put first on PYTHONPATH, e.g. a
``git worktree`` of an older commit), in separate processes alternating with this one, so "before" and
"after" come from the same run on the same machine.  Only differences within one run mean anything
on a shared CPU.

  python benchmarks/profile_step.py --configs vanilla,chain,tree:tree-2x2x1 --batch-sizes 1,4,16 \\
      --max-new-tokens 16 --name profile_step

Configurations: vanilla, falcon (the drafter's own recommendation), chain[:K], lookup[:K[:F[:L[:N]]]],
tree[:<tree>] (Falcon, --drafter), eagle[:K] (vLLM's own EAGLE proposer, --eagle-drafter) and ngram[:K];
``<config>%key=value`` adds a speculative-config key, ``<config>@<dir>`` names another drafter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections import defaultdict

from harness.engines import spec_for  # sets the environment: in-process engine, offline
from harness.machine import cpu_name
from harness.paths import RESULTS, ROOT, drafters_for, portable_text
from harness.timing import Timers

COMPONENTS = ("step", "target forward", "attention", "tree attention", "lm head", "sampler", "compaction",
              "drafting", "drafter passes", "bookkeeping")


def run_worker(args) -> list[dict]:
    """Profile every configuration in this process (the code on sys.path); one engine at a time."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from falcon_vllm.models import chat_ids, load_chat_prompts, model_path

    model = args.model or str(model_path())
    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for q in load_chat_prompts("mt-bench", max(args.batch_sizes)):
        prompts.append(chat_ids(tok, [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True))
    rows = []
    for cfg in args.configs:
        llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=not args.compile,
                  max_num_seqs=max(args.batch_sizes), disable_log_stats=False, seed=0, enable_prefix_caching=False,
                  speculative_config=spec_for(cfg, args.drafter, args.num_spec_tokens, args.eagle_drafter))
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        timers = Timers()
        in_target = {"n": 0}
        orig_fwd = type(runner)._model_forward

        def model_forward(self, *a, **kw):
            in_target["n"] += 1
            try:
                return orig_fwd(self, *a, **kw)
            finally:
                in_target["n"] -= 1

        runner._model_forward = model_forward.__get__(runner)
        timers.wrap(runner, "_model_forward", "target forward")
        timers.wrap(runner.model, "compute_logits", "lm head")
        timers.wrap(runner, "_sample", "sampler")
        timers.wrap(runner, "propose_draft_token_ids", "drafting")
        if getattr(runner, "drafter", None) is not None:
            timers.wrap(runner.drafter, "propose", "drafter passes")
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
        orig_attn = timers.wrap(CPUAttentionBackendImpl, "forward", "attention", when=lambda: in_target["n"] > 0)
        restore = [(CPUAttentionBackendImpl, "forward", orig_attn)]
        for owner, attr, component in tree_timed():
            restore.append((owner, attr, timers.wrap(owner, attr, component)))
        timers.wrap(llm.llm_engine, "step", "step")
        for B in args.batch_sizes:
            batch = [{"prompt_token_ids": p} for p in prompts[:B]]
            sp = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, ignore_eos=True)
            llm.generate(batch, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
            timers.total.clear()
            timers.calls.clear()
            timers.on = True
            t0 = time.perf_counter()
            toks = 0
            for _ in range(args.repeats):
                outs = llm.generate(batch, sp, use_tqdm=False)
                toks += sum(len(o.outputs[0].token_ids) for o in outs)
            wall = time.perf_counter() - t0
            timers.on = False
            steps = max(1, timers.calls["step"])
            ms = {c: 1e3 * timers.total.get(c, 0.0) / steps for c in COMPONENTS if c != "bookkeeping"}
            ms["bookkeeping"] = ms["step"] - ms["target forward"] - ms["lm head"] - ms["sampler"] - ms["drafting"]
            rows.append({"config": portable_text(cfg), "batch_size": B, "steps": steps, "generated_tokens": toks,
                         "tokens_per_step": toks / steps, "tokens_per_s": toks / wall, "ms_per_step": ms,
                         "share": {c: ms[c] / ms["step"] for c in COMPONENTS},
                         "calls_per_step": {c: timers.calls[c] / steps for c in timers.calls}})
            print(json.dumps({"config": cfg, "B": B, "step_ms": round(ms["step"], 2),
                              "tok/step": round(toks / steps, 2)}), file=sys.stderr, flush=True)
        for owner, attr, orig in restore:
            setattr(owner, attr, orig)
        # falcon_vllm.vllm.engine.shutdown_llm, inline: --compare runs this worker on older checkouts
        # (their falcon_vllm first on the path), which lack it
        llm.llm_engine.engine_core.shutdown()
        del llm, runner
        import gc
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        cleanup_dist_env_and_memory()
    return rows


# ------------------------------------------------------------------------------------------ driver
def _worker_cmd(args, configs, out):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out, "--configs", ",".join(configs),
           "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--max-new-tokens", str(args.max_new_tokens),
           "--repeats", str(args.repeats), "--drafter", args.drafter, "--eagle-drafter", args.eagle_drafter,
           "--num-spec-tokens", str(args.num_spec_tokens), "--temperature", str(args.temperature)]
    if args.compile:
        cmd += ["--compile"]
    if args.model:
        cmd += ["--model", args.model]
    return cmd


def tree_timed() -> list[tuple]:
    """(owner, attribute, component) of tree mode's timed functions (the sampler's compaction calls the
    module-level ``compact``)."""
    from falcon_vllm.vllm import tree_verify

    return [(tree_verify.VerifyTreeAttention, "attend", "tree attention"), (tree_verify, "compact", "compaction")]


def run_driver(args) -> list[dict]:
    versions = [("after", ROOT)]
    if args.compare:
        versions = [("before", os.path.abspath(args.compare)), ("after", ROOT)]
    rows = []
    for rnd in range(args.rounds):
        for cfg in args.configs:
            # the code versions of one configuration run side by side (--parallel) or one after the other,
            # so load drift on a shared machine hits both alike
            procs = []
            for label, root in versions:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                             if p]))
                tmp = os.path.join(RESULTS, f".{args.name}.{label}.part.json")
                procs.append((label, root, tmp, subprocess.Popen(_worker_cmd(args, [cfg], tmp), env=env, cwd=root)))
                if not args.parallel:
                    procs[-1][3].wait()
            for label, root, tmp, proc in procs:
                if proc.wait() != 0:
                    raise SystemExit(f"falcon-vllm: worker {label} {cfg} failed ({proc.returncode})")
                with open(tmp) as f:
                    for r in json.load(f):
                        r.update(version=label, round=rnd, code=_code_id(root))
                        rows.append(r)
                os.remove(tmp)
            _write(args, rows)  # partial results survive an interrupted run
    return rows


def _code_id(root):
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() + ("+dirty" if subprocess.run(
                                  ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                  capture_output=True, text=True).stdout.strip() else "")
    except OSError:
        return None


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def summarise(rows):
    """Median over rounds per (version, config, batch)."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["version"], r["config"], r["batch_size"])].append(r)
    out = []
    for (v, c, b), rs in groups.items():
        ms = {k: _median([r["ms_per_step"][k] for r in rs]) for k in COMPONENTS}
        out.append({"version": v, "config": c, "batch_size": b, "rounds": len(rs),
                    "tokens_per_step": _median([r["tokens_per_step"] for r in rs]),
                    "tokens_per_s": _median([r["tokens_per_s"] for r in rs]), "ms_per_step": ms,
                    "share": {k: ms[k] / ms["step"] for k in COMPONENTS}})
    return out


def markdown(summary, args, command) -> str:
    lines = [f"# Step profile: {args.name}", "", f"Command: `{command}`", "",
             f"Machine: {cpu_name()}; "
             f"{args.max_new_tokens} new tokens x {args.repeats} repeat(s) per batch, MT-Bench prompts, "
             + (f"temperature {args.temperature:g}, " if args.temperature else "greedy, ") +
             f"{args.rounds} round(s) (median){'; versions run side by side' if args.parallel else ''}; "
             f"{'torch.compile (vLLM default)' if args.compile else 'eager'}.  ms per step (share of the step).  tree attention is part of "
             "attention, which is part of target forward; compaction is part of sampler; drafter passes are "
             "part of drafting.", ""]
    head = ["version", "config", "B", "tok/step", "tok/s"] + list(COMPONENTS)
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sorted(summary, key=lambda s: (s["config"], s["batch_size"], s["version"] != "before")):
        cells = [s["version"], s["config"], str(s["batch_size"]), f"{s['tokens_per_step']:.2f}",
                 f"{s['tokens_per_s']:.1f}"]
        for c in COMPONENTS:
            ms = s["ms_per_step"][c]
            cells.append(f"{ms:.1f}" if c == "step" else f"{ms:.1f} ({100 * s['share'][c]:.0f}%)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="vanilla,chain,tree:tree-2x2x1",
                   help="comma list of vanilla, chain[:K], tree[:<preset or tune-tree file>]")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1, help="timed generations per batch size")
    p.add_argument("--rounds", type=int, default=1, help="driver: repetitions of the whole schedule (median)")
    p.add_argument("--num-spec-tokens", type=int, default=4, help="chain length K of `chain`")
    p.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (0: greedy)")
    p.add_argument("--drafter", default=None,
                   help="Falcon drafter (default: the one shipped for --model, as \"model\": \"falcon\" finds it)")
    p.add_argument("--eagle-drafter", default=None, help="EAGLE drafter (vLLM's layout) of `eagle[:K]`")
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct, converted)")
    p.add_argument("--compile", action="store_true",
                   help="vLLM's default torch.compile mode (as `vllm serve` runs) instead of eager")
    p.add_argument("--compare", default=None, help="checkout of the code to profile as 'before'")
    p.add_argument("--parallel", action="store_true",
                   help="with --compare: run the two versions of a configuration at the same time")
    p.add_argument("--name", default="profile_step")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.drafter, a.eagle_drafter = drafters_for(a.model, a.drafter, a.eagle_drafter)
    a.configs = [c for c in a.configs.split(",") if c]
    a.batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        rows = run_worker(args)
        with open(args.out, "w") as f:
            json.dump(rows, f)
        return 0
    args.command = "python benchmarks/profile_step.py " + " ".join(shlex.quote(portable_text(x))
                                                                   for x in (argv or sys.argv[1:]))
    print(_write(args, run_driver(args)))
    return 0


def _write(args, rows) -> str:
    summary = summarise(rows)
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, args.name)
    with open(base + ".json", "w") as f:
        json.dump({"command": args.command, "machine": platform.platform(), "summary": summary, "rows": rows}, f,
                  indent=1)
    md = markdown(summary, args, args.command)
    with open(base + ".md", "w") as f:
        f.write(md)
    return md


if __name__ == "__main__":
    sys.exit(main())
