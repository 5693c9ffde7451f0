#!/usr/bin/env python
"""Resident memory of an in-process vLLM engine over many rounds of requests, per configuration.

Each configuration runs in its own process (one engine, prefix caching on, the soak's prompts of mixed
lengths, new prompts every round unless --same-prompts).  After each round of ``--requests`` sampled
requests the process reports its resident memory (VmRSS), then calls glibc's ``malloc_trim(0)`` and
reports it again: memory that the trim returns was free but held by the allocator (fragmentation), memory
that stays is in use.  A leak grows round after round without bound; a working set that settles (caches
and allocator pools warming up over new shapes) flattens.  The configurations run one after the other on
the same machine, in one invocation.  Writes results/<name>.json and .md after every round.

    python benchmarks/memory_rounds.py --configs vanilla,falcon --rounds 40 --name memory_rounds_smollm2
"""

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

from harness.engines import spec_for  # sets the environment: in-process engine, offline
from harness.paths import DEFAULT_DRAFTER, DEFAULT_EAGLE, RESULTS, portable

from falcon_vllm.soak import make_prompts, rss_mb


def run_worker(a) -> None:
    from vllm import LLM, SamplingParams

    from falcon_vllm.models import model_path

    trim = ctypes.CDLL("libc.so.6").malloc_trim
    llm = LLM(model=a.model or str(model_path()), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              enable_prefix_caching=True, max_num_seqs=a.max_num_seqs,
              speculative_config=spec_for(a.configs, a.drafter, 2, a.eagle_drafter))
    params = SamplingParams(max_tokens=a.max_new_tokens, temperature=a.temperature, top_p=0.95, ignore_eos=True)
    t0 = time.time()
    for rnd in range(a.rounds):
        prompts = make_prompts(a.requests, a.max_words, 0 if a.same_prompts else rnd)
        llm.generate(prompts, params, use_tqdm=False)
        gc.collect()
        held = rss_mb(os.getpid())
        trim(0)
        print("ROUND " + json.dumps({"round": rnd, "rss_mib": round(held, 1),
                                     "rss_trimmed_mib": round(rss_mb(os.getpid()), 1),
                                     "seconds": round(time.time() - t0, 1)}), flush=True)


def summarise(series: list[dict], tail: int) -> dict:
    trimmed = [r["rss_trimmed_mib"] for r in series]
    out = {"rounds": len(series), "first_trimmed_mib": trimmed[0], "last_trimmed_mib": trimmed[-1],
           "growth_trimmed_mib": round(trimmed[-1] - trimmed[0], 1),
           "growth_last_rounds_mib": None, "last_rss_mib": series[-1]["rss_mib"]}
    if len(trimmed) > tail:
        out["growth_last_rounds_mib"] = round(trimmed[-1] - trimmed[-1 - tail], 1)
    return out


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [f"# Engine memory over rounds of requests ({res['name']})", "",
             f"Command: `{res['command']}`", "",
             f"Machine: {res['machine']}. Each round: {a['requests']} sampled requests (T {a['temperature']}, "
             f"{a['max_new_tokens']} tokens each, prompts of 3 to {a['max_words']} words, "
             f"{'the same prompts every round' if a['same_prompts'] else 'new prompts every round'}), "
             f"max_num_seqs {a['max_num_seqs']}, prefix caching on, one engine per configuration in its own process. "
             "RSS after the round, then after `malloc_trim(0)` (what the allocator held but did not use is returned).",
             "", f"| config | rounds | trimmed RSS after round 1 (MiB) | at the end | growth | growth over the last "
             f"{a['tail']} rounds | RSS at the end, untrimmed |", "|---|---|---|---|---|---|---|"]
    for cfg, s in res["summary"].items():
        lines.append(f"| {cfg} | {s['rounds']} | {s['first_trimmed_mib']:.0f} | {s['last_trimmed_mib']:.0f} | "
                     f"{s['growth_trimmed_mib']:+.0f} | "
                     f"{'' if s['growth_last_rounds_mib'] is None else format(s['growth_last_rounds_mib'], '+.0f')} | "
                     f"{s['last_rss_mib']:.0f} |")
    lines += ["", "Trimmed RSS per round (MiB):", ""]
    for cfg, series in res["series"].items():
        lines.append(f"- {cfg}: " + ", ".join(f"{r['rss_trimmed_mib']:.0f}" for r in series))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="vanilla,falcon",
                    help="comma-separated, as profile_step.py takes them (vanilla, falcon, lookup:..., %%key=value)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--requests", type=int, default=12, help="requests per round")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--max-words", type=int, default=300, help="longest prompt, words")
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--same-prompts", action="store_true", help="repeat the first round's prompts every round")
    ap.add_argument("--tail", type=int, default=10, help="report the growth over this many last rounds")
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER)
    ap.add_argument("--eagle-drafter", default=DEFAULT_EAGLE)
    ap.add_argument("--name", default="memory_rounds_smollm2")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        run_worker(a)
        return 0
    import platform

    configs = [c for c in a.configs.split(",") if c]
    for cfg in configs:
        spec_for(cfg, a.drafter, 2, a.eagle_drafter)  # an unknown name fails before any engine starts
    res = {"name": a.name, "command": "python benchmarks/memory_rounds.py " + " ".join(sys.argv[1:]),
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
           "args": {k: portable(v) for k, v in vars(a).items() if k != "worker"}, "series": {}, "summary": {}}
    out = os.path.join(RESULTS, a.name)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")  # the engine in the worker's own process
    for cfg in configs:
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--worker", "--configs", cfg]
        series = res["series"][cfg] = []
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if not line.startswith("ROUND "):
                continue
            series.append(json.loads(line[6:]))
            res["summary"][cfg] = summarise(series, a.tail)
            print(cfg, json.dumps(series[-1]), flush=True)
            with open(out + ".json", "w") as f:
                json.dump(res, f, indent=1)
            with open(out + ".md", "w") as f:
                f.write(markdown(res))
        if proc.wait() != 0:
            raise SystemExit(f"falcon-vllm: worker for {cfg} failed ({proc.returncode})")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
