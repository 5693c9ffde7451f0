#!/usr/bin/env python
"""Soak test of ``falcon-vllm serve`` (tree mode, or the drafter's own recommendation) on loopback, against a vanilla server.

Many concurrent clients for a bounded time: greedy and sampled requests of mixed lengths, streamed
or not, completions and chat, random client disconnects (aborts) and malformed requests.  Checks:
no crash (/health at the end), every malformed request answered 4xx and every other 200, greedy
answers identical to a vanilla server's (started afterwards with the same flags, same prompts),
resident memory of the server's process tree flat after warm-up, spec-decode counters from /metrics
consistent.  Writes <out>.json and <out>.md; exits 1 when a check failed.  See falcon_vllm/soak.py.

    python benchmarks/soak_server.py --duration 240 --clients 32   # SmolLM2 + the shipped drafter, a tree
    python benchmarks/soak_server.py --tree default --clients 4 --max-num-seqs 4   # its serving.json
"""

import argparse
import json
import os
import sys

from harness.paths import DEFAULT_DRAFTER, RESULTS, ROOT

from falcon_vllm.soak import markdown, soak


def main(argv=None) -> int:
    from falcon_vllm.models import model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct, falcon_vllm.models)")
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER)
    ap.add_argument("--tree", default="tree-2x2x1",
                    help="tree preset, paths or file; a chain-N runs chain mode; `default`: the drafter's own "
                         "recommendation (its serving.json: what `{\"method\": \"falcon\", \"model\": <drafter>}` gets); "
                         "`vanilla`: the same load on a server without speculation (memory and latency baseline)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of load")
    ap.add_argument("--min-completed", type=int, default=0,
                    help="keep the load on past --duration until this many requests completed (fewer is a failure)")
    ap.add_argument("--max-duration", type=float, default=None,
                    help="longest soak when --min-completed is not reached (default: 4x --duration)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-words", type=int, default=300, help="longest prompt, words")
    ap.add_argument("--p-abort", type=float, default=0.1)
    ap.add_argument("--p-malformed", type=float, default=0.1)
    ap.add_argument("--p-greedy", type=float, default=0.4, help="share of the well-formed requests that are greedy")
    ap.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed growth after warm-up (fraction)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="/tmp/falcon-soak", help="server logs")
    ap.add_argument("--out", default=None, help="<out>.json, <out>.md (default: results/soak_smollm2_tree, or "
                                                 "results/soak_smollm2_<default|vanilla> with that --tree)")
    a = ap.parse_args(argv)
    model = str(a.model or model_path())
    server_args = ["--dtype", "float32", "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
                   "--enforce-eager"]
    kind = a.tree if a.tree in ("default", "vanilla") else "tree"
    spec = {"method": "falcon", "model": os.path.abspath(a.drafter)} | ({"tree": a.tree} if kind == "tree" else {})
    spec_args = [] if kind == "vanilla" else ["--speculative-config", json.dumps(spec)]
    a.out = a.out or os.path.join(RESULTS, "soak_smollm2_" + kind)
    res = soak(model, server_args, spec_args, a.workdir, clients=a.clients,
               duration=a.duration, num_prompts=a.num_prompts, max_words=a.max_words, p_abort=a.p_abort,
               p_malformed=a.p_malformed, p_greedy=a.p_greedy, seed=a.seed, max_rss_growth=a.max_rss_growth,
               min_completed=a.min_completed, max_duration=a.max_duration)
    def local(text: str) -> str:  # results name the project's files, not where they lay on this machine
        return text.replace(ROOT + os.sep, "").replace(os.path.dirname(model) + os.sep, "")

    with open(a.out + ".json", "w") as f:
        f.write(local(json.dumps(res, indent=1, default=str)))
    with open(a.out + ".md", "w") as f:
        f.write(local(markdown(res)))
    print(markdown(res))
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
