#!/usr/bin/env python
"""Study: Do the drafter's RMSNorms run faster through vLLM's C++ CPU kernels (CpuRMSNorm) than through vLLM's native
RMSNorm?

Answer: Yes: drafting 8.85 against 9.47 ms per step on a 2-core AVX2 EPYC, same drafts, outputs identical; the
plugin serves the C++ kernels since.
Result: benchmarks/results/ab_draft_norm_b1_mt-bench_avx2.md

Side by side in one process: the Falcon drafter's RMSNorms through vLLM's C++ CPU kernels (``CpuRMSNorm``,
what the plugin serves) against vLLM's native RMSNorm (what vLLM's CPU platform runs), and vanilla vLLM.

Three engines (the drafter's ``serving.json`` default, built with and without ``use_cpu_norm_kernels``, and
vanilla), generations alternating over the same prompts (order rotating), greedy.  Reports each engine's wall
time, its speedup over vanilla on the whole workload, drafting ms per step (the runner's
``propose_draft_token_ids``) and whether its outputs equal vanilla's.

  python benchmarks/studies/ab_draft_norm.py --prompts 16 --max-new-tokens 96 --name ab_draft_norm_b1_mt-bench
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness

from harness.engines import spec_for  # noqa: E402  (sets the environment: in-process engine, offline)
from harness.machine import cpu_name  # noqa: E402
from harness.paths import DEFAULT_DRAFTER, RESULTS  # noqa: E402
from harness.report import write_report  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--name", default="ab_draft_norm")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    import falcon_vllm.vllm.model as fm
    from falcon_vllm.models import chat_ids, load_chat_prompts, model_path

    model = str(model_path())
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [chat_ids(tok, [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True)
               for q in load_chat_prompts(args.dataset, args.prompts)]
    sp = SamplingParams(max_tokens=args.max_new_tokens, temperature=0)
    swap = fm.use_cpu_norm_kernels
    engines, drafting = {}, collections.defaultdict(list)
    for name in ("kernel norms", "native norms", "vanilla"):
        fm.use_cpu_norm_kernels = swap if name == "kernel norms" else (lambda model: None)
        try:
            engines[name] = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, max_num_seqs=1,
                                seed=0, enable_prefix_caching=False,
                                speculative_config=None if name == "vanilla" else spec_for("falcon", DEFAULT_DRAFTER, 4))
        finally:
            fm.use_cpu_norm_kernels = swap
        runner = engines[name].llm_engine.model_executor.driver_worker.worker.model_runner
        if name != "vanilla":
            def timed(*a, _orig=runner.propose_draft_token_ids, _name=name, **kw):
                t = time.perf_counter()
                try:
                    return _orig(*a, **kw)
                finally:
                    drafting[_name].append(time.perf_counter() - t)
            runner.propose_draft_token_ids = timed
        engines[name].generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)  # warm-up
    drafting.clear()
    names = list(engines)
    wall, outs = collections.defaultdict(float), collections.defaultdict(list)
    for i, prompt in enumerate(prompts):
        for name in names[i % 3:] + names[:i % 3]:
            t = time.perf_counter()
            out = engines[name].generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            wall[name] += time.perf_counter() - t
            outs[name].append(list(out[0].outputs[0].token_ids))
    rows = [{"config": n, "wall_s": round(wall[n], 3), "speedup_total": round(wall["vanilla"] / wall[n], 4),
             "drafting_ms_per_step": round(1e3 * sum(drafting[n]) / len(drafting[n]), 3) if drafting[n] else None,
             "drafting_steps": len(drafting[n]), "identical_to_vanilla": outs[n] == outs["vanilla"]} for n in names]
    command = "python benchmarks/studies/ab_draft_norm.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Drafter RMSNorm kernels, side by side: {args.name}", "", f"Command: `{command}`", "",
             f"Machine: {cpu_name()}.  Three engines in one process, batch 1, greedy, {args.prompts} {args.dataset} "
             f"prompts x up to {args.max_new_tokens} tokens (stopping at EOS), generations alternating (order "
             "rotating); falcon = the drafter's serving.json default.  speedup: vanilla's wall time over the "
             "engine's, whole workload; drafting: the runner's propose_draft_token_ids per step.", "",
             "| engine | wall s | speedup vs vanilla | drafting ms/step | drafting steps | identical to vanilla |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['wall_s']:.2f} | {r['speedup_total']:.3f}x | "
                     f"{'-' if r['drafting_ms_per_step'] is None else r['drafting_ms_per_step']} | "
                     f"{r['drafting_steps']} | {r['identical_to_vanilla']} |")
    write_report(RESULTS, args.name,
                 {"command": command, "machine": cpu_name(), "dataset": args.dataset, "prompts": args.prompts,
                  "max_new_tokens": args.max_new_tokens, "rows": rows}, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
