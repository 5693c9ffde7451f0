"""Behaviour fingerprint: every configuration's output tokens and spec-decode counters on fixed prompts.

A refactor that claims "behaviour unchanged" runs this on the code before and after and compares the two files:
the same tokens (greedy, and sampled with fixed per-request seeds) and the same counters (drafts, draft tokens,
accepted tokens per position) mean the drafter proposed the same tokens at every step.  Time is not measured.

  python benchmarks/fingerprint.py --out /tmp/before.json          # on the old code
  python benchmarks/fingerprint.py --out /tmp/after.json --compare /tmp/before.json

It imports only ``falcon_vllm`` and vLLM (no other benchmark module), so the same file runs against an older
checkout: ``PYTHONPATH=<old checkout> python benchmarks/fingerprint.py ...`` (the JSON records which
``falcon_vllm`` it imported).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CONFIGS = {  # name -> speculative config (a function of the drafter directory)
    "vanilla": lambda d: None,
    "falcon": lambda d: {"method": "falcon", "model": d},
    "chain:2": lambda d: {"method": "falcon", "model": d, "num_speculative_tokens": 2},
    "chain:4": lambda d: {"method": "falcon", "model": d, "num_speculative_tokens": 4},
    "tree": lambda d: {"method": "falcon", "model": d, "tree": "tree-2x2x1"},
}


def fingerprint(args) -> dict:
    import falcon_vllm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from falcon_vllm.models import chat_ids, load_chat_prompts, model_path
    from falcon_vllm.vllm.engine import shutdown_llm, spec_counters

    model = args.model or str(model_path())
    drafter = args.drafter or os.path.join(os.path.dirname(falcon_vllm.__file__), "drafters", "smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [{"prompt_token_ids": chat_ids(tok, [{"role": "user", "content": q["turns"][0]}],
                                             add_generation_prompt=True)}
               for q in load_chat_prompts(args.dataset, args.prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    sampled = [SamplingParams(temperature=0.7, max_tokens=args.max_new_tokens, seed=1000 + i)
               for i in range(len(prompts))]
    out = {"falcon_vllm": os.path.dirname(falcon_vllm.__file__), "dataset": args.dataset,
           "max_new_tokens": args.max_new_tokens, "configs": {}}
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"fingerprint: unknown configuration {name!r} (one of {', '.join(CONFIGS)})")
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                  max_num_seqs=max(sizes), enable_prefix_caching=False, disable_log_stats=False,
                  speculative_config=CONFIGS[name](drafter))
        try:
            row = {}
            for b in sizes:  # the prompts in waves of b requests: every step of a wave runs at batch <= b
                for mode, params in (("greedy", [greedy] * len(prompts)), ("sampled", sampled)):
                    toks = []
                    for i in range(0, len(prompts), b):
                        gens = llm.generate(prompts[i:i + b], params[i:i + b], use_tqdm=False)
                        toks += [list(g.outputs[0].token_ids) for g in gens]
                    row[f"b{b} {mode}"] = toks
                    row[f"b{b} {mode} counters"] = spec_counters(llm)  # cumulative since the engine started
            out["configs"][name] = row
        finally:
            shutdown_llm(llm)
    return out


def compare(new: dict, old: dict) -> list[str]:
    """Every difference between two fingerprints (empty: the same behaviour)."""
    diffs = []
    for name, row in new["configs"].items():
        if name not in old["configs"]:
            diffs.append(f"{name}: not in the older fingerprint")
            continue
        for key, value in row.items():
            if not key.endswith("counters"):  # the tokens of every prompt
                bad = [i for i, (a, b) in enumerate(zip(value, old["configs"][name][key])) if a != b]
                if bad or len(value) != len(old["configs"][name][key]):
                    diffs.append(f"{name} {key}: prompts {bad} differ")
            elif value != old["configs"][name].get(key):
                diffs.append(f"{name} {key}: {value} != {old['configs'][name].get(key)}")
    return diffs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--prompts", type=int, default=8, help="MT-Bench first turns (default: %(default)s)")
    p.add_argument("--batch-sizes", default="1,4", help="the prompts run in waves of this many requests")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct, converted)")
    p.add_argument("--drafter", default=None, help="default: the shipped SmolLM2 drafter of the imported package")
    p.add_argument("--out", required=True, help="the fingerprint's JSON")
    p.add_argument("--compare", default=None, help="an older fingerprint: print every difference, exit 1 on any")
    args = p.parse_args(argv)
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                       ("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)  # the engine in this process, offline
    fp = fingerprint(args)
    with open(args.out, "w") as f:
        json.dump(fp, f)
    print(f"wrote {args.out} ({len(fp['configs'])} configurations, falcon_vllm from {fp['falcon_vllm']})")
    if args.compare:
        with open(args.compare) as f:
            diffs = compare(fp, json.load(f))
        print("\n".join(diffs) if diffs else f"identical to {args.compare}: tokens and counters")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
