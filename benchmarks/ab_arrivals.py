"""Serving under load: requests arriving at random times (Poisson), every engine in one process, traces alternating.

``ab_step.py`` times fixed batches. A server sees requests arrive while others run, so its batch grows and
shrinks from step to step, and a schedule that drafts at small batches and not at large ones switches
mid-request. Here each trace is a list of requests with Poisson arrival times (``--rate`` requests per second);
every configuration serves the same trace in this process (vLLM's engine driven step by step; a request is added
once the clock passes its arrival time, so one that arrives during a step waits for it, as in a server), the order
of the configurations rotating from trace to trace. Per request: latency (arrival to last token), time to first
token and time per output token after the first. The speedup is the baseline's mean latency over the
configuration's on the same trace: the median over the traces, and over all requests of all traces (total).
Greedy outputs are compared with the baseline's request by request.

  python benchmarks/ab_arrivals.py --configs vanilla,falcon --rates 0.3,0.6 --requests 16 --traces 4 \\
      --max-new-tokens 96 --compile --name ab_arrivals_mt-bench

Configurations as in ab_step.py (``%key=value``, ``^attr=value``, ``@<drafter>`` included).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

# several engines live in this process: 1 GiB of KV cache each (harness.engines sets the rest of the environment)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from harness.engines import build_engines, command_line, compile_words  # noqa: E402  (sets the environment)
from harness.machine import cpu_name  # noqa: E402
from harness.paths import DEFAULT_DRAFTER, DEFAULT_EAGLE, RESULTS  # noqa: E402
from harness.report import write_report  # noqa: E402


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """n Poisson arrival times (seconds from the trace's start) at ``rate`` requests per second, the first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def serve_trace(engine, prompts: list[dict], times: list[float], sp, tag: str = "") -> list[dict]:
    """Serve ``prompts[j]`` arriving at ``times[j]`` on a vLLM LLMEngine; per request: its tokens, latency, TTFT."""
    n = len(prompts)
    first, done = [None] * n, [None] * n
    index = {f"{tag}r{j}": j for j in range(n)}  # request id -> j
    nxt = finished = 0
    t0 = time.perf_counter()
    while finished < n:
        now = time.perf_counter() - t0
        while nxt < n and times[nxt] <= now:
            engine.add_request(f"{tag}r{nxt}", prompts[nxt], sp)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, times[nxt] - now))
            continue
        for out in engine.step():
            j = index[out.request_id]
            now = time.perf_counter() - t0
            if first[j] is None and out.outputs and out.outputs[0].token_ids:
                first[j] = now
            if out.finished:
                done[j] = {"tokens": list(out.outputs[0].token_ids), "latency": now - times[j],
                           "ttft": first[j] - times[j], "decode": now - first[j]}
                finished += 1
    return done


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args) -> list[dict]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from falcon_vllm.models import chat_ids, load_chat_prompts, model_path

    model = args.model or str(model_path())
    tok = AutoTokenizer.from_pretrained(model)
    questions = load_chat_prompts(args.dataset, args.prompts or args.requests * args.traces)
    prompts = [{"prompt_token_ids": chat_ids(tok, [{"role": "user", "content": q["turns"][0]}],
                                             add_generation_prompt=True)} for q in questions]
    labels, engines, switch, step_count = build_engines(args, model, args.max_num_seqs)
    base = labels[0]
    sp = SamplingParams(max_tokens=args.max_new_tokens, temperature=0, ignore_eos=not args.stop_at_eos)
    for c, llm in engines.items():  # warm-up
        switch(c)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
    rows = []
    for rate in args.rates:
        reqs = {c: [] for c in labels}  # every request of every trace, in trace order
        trace_lat = {c: [] for c in labels}  # mean latency per trace
        makespan = {c: 0.0 for c in labels}
        steps = {c: [0, 0] for c in labels}  # model steps, requests scheduled over them
        for i in range(args.traces):
            times = arrivals(rate, args.requests, args.seed * 1000 + i)
            batch = [prompts[(i * args.requests + j) % len(prompts)] for j in range(args.requests)]
            order = [labels[(i + k) % len(labels)] for k in range(len(labels))]  # rotate
            for c in order:
                switch(c)
                before = list(step_count[c])
                t0 = time.perf_counter()
                done = serve_trace(engines[c].llm_engine, batch, times, sp, f"{rate:g}t{i}")
                makespan[c] += time.perf_counter() - t0
                steps[c][0] += step_count[c][0] - before[0]
                steps[c][1] += step_count[c][2] - before[2]
                reqs[c] += done
                trace_lat[c].append(statistics.fmean([d["latency"] for d in done]))
            print(json.dumps({"rate": rate, "trace": i, **{c: round(trace_lat[c][-1], 3) for c in labels}}),
                  file=sys.stderr, flush=True)
        for c in labels:
            lat = [d["latency"] for d in reqs[c]]
            tpot = [d["decode"] / (len(d["tokens"]) - 1) for d in reqs[c] if len(d["tokens"]) > 1]
            ratios = [b / s for b, s in zip(trace_lat[base], trace_lat[c])]
            tokens = sum(len(d["tokens"]) for d in reqs[c])
            rows.append({
                "config": c, "rate": rate, "traces": args.traces, "requests": len(lat),
                "latency_mean_s": statistics.fmean(lat), "latency_p50_s": _pct(lat, 0.5),
                "latency_p90_s": _pct(lat, 0.9), "ttft_mean_s": statistics.fmean([d["ttft"] for d in reqs[c]]),
                "tpot_mean_ms": 1e3 * statistics.fmean(tpot),
                "tokens_per_request": tokens / len(lat), "tokens_per_s": tokens / makespan[c],
                "mean_batch": steps[c][1] / max(1, steps[c][0]), "steps": steps[c][0],
                "speedup_vs_base": statistics.median(ratios), "speedup_min": min(ratios),
                "speedup_max": max(ratios),
                "speedup_total": sum(d["latency"] for d in reqs[base]) / sum(lat),
                "identical_to_base": sum(a["tokens"] == b["tokens"] for a, b in zip(reqs[c], reqs[base])),
            })
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}),
                  file=sys.stderr, flush=True)
    return rows


def write(args, rows) -> None:
    cmd = command_line("ab_arrivals.py")
    meta = {"command": cmd, "machine": cpu_name(), "baseline": args.configs[0], "dataset": args.dataset,
            "max_new_tokens": args.max_new_tokens, "max_num_seqs": args.max_num_seqs, "compile": args.compile,
            "stop_at_eos": args.stop_at_eos}
    lines = [f"# Serving under Poisson arrivals, in one process: {args.name}", "", f"Command: `{cmd}`", "",
             f"Machine: {meta['machine']}.  {args.traces} traces of {args.requests} requests per rate "
             f"({args.dataset} prompts, greedy, up to {args.max_new_tokens} tokens, "
             f"{'stopping at EOS' if args.stop_at_eos else 'EOS ignored'}; max_num_seqs {args.max_num_seqs}; "
             f"{compile_words(args.compile)}); every configuration serves the same traces, the order rotating. "
             f"latency: arrival to last token; TTFT: arrival to first token; TPOT: seconds per token after the "
             f"first; batch: requests per model step, averaged over steps.  speedup = the baseline's mean latency "
             f"over the configuration's on the same trace, median (min-max) over traces; total: over every request; "
             f"baseline `{args.configs[0]}`.  identical: requests whose tokens equal the baseline's.", "",
             "| config | rate (req/s) | latency mean / p50 / p90 (s) | TTFT (s) | TPOT (ms) | tok/s | batch | "
             "speedup vs baseline | min-max | total | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['rate']:g} | {r['latency_mean_s']:.2f} / {r['latency_p50_s']:.2f} / "
                     f"{r['latency_p90_s']:.2f} | {r['ttft_mean_s']:.2f} | {r['tpot_mean_ms']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['mean_batch']:.2f} | {r['speedup_vs_base']:.3f}x | "
                     f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f} | {r['speedup_total']:.3f}x | "
                     f"{r['identical_to_base']}/{r['requests']} |")
    write_report(RESULTS, args.name, {**meta, "rows": rows}, lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="vanilla,falcon", help="comma-separated; the first is the baseline")
    p.add_argument("--rates", default="0.3", help="comma-separated Poisson arrival rates, requests per second")
    p.add_argument("--requests", type=int, default=16, help="requests per trace")
    p.add_argument("--traces", type=int, default=4, help="traces per rate (each served by every configuration)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--stop-at-eos", action="store_true", help="requests stop at EOS (default: EOS ignored)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="vLLM's max_num_seqs of every engine")
    p.add_argument("--prompts", type=int, default=0,
                   help="rotate over the first N prompts (default: --requests x --traces, as the set allows)")
    p.add_argument("--dataset", default="mt-bench", help="prompt set of falcon_vllm.models.load_chat_prompts")
    p.add_argument("--num-spec-tokens", type=int, default=2, help="K of `chain` / `ngram` without one")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER)
    p.add_argument("--eagle-drafter", default=DEFAULT_EAGLE, help="EAGLE drafter (vLLM's layout) of `eagle[:K]`")
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct, converted)")
    p.add_argument("--compile", nargs="?", const="all", default="", metavar="LABELS",
                   help="vLLM's default torch.compile mode for every engine or the labels given (as ab_step.py)")
    p.add_argument("--name", default="ab_arrivals")
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    if len(args.configs) < 2:
        raise SystemExit("falcon-vllm: --configs needs a baseline and at least one configuration to compare")
    if min(args.rates, default=0) <= 0 or args.requests < 1 or args.traces < 1:
        raise SystemExit("falcon-vllm: --rates must be > 0, --requests and --traces >= 1")
    write(args, run(args))


if __name__ == "__main__":
    main()
