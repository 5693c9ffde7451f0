"""Run by tests/test_vllm_tp.py in a fresh process (vLLM spawns one worker per tensor-parallel rank):
greedy tokens, one seeded sampled request's tokens and the spec counters of one engine, as JSON on stdout.
Args: target, drafter, mode (vanilla, chain, tree, default), ranks ("2": TP=2, "pp2": PP=2)[, datastore]."""

import json
import os
import sys

PROMPTS = [[11, 12, 13], list(range(200, 237)), [5] * 9]


def spec_config(mode: str, drafter: str, datastore: str | None):
    return {"vanilla": None,
            "chain": {"method": "falcon", "model": drafter, "num_speculative_tokens": 3},
            "tree": {"method": "falcon", "model": drafter, "tree": "tree-3x2x1"},
            # the shipped default's features: prompt lookup, the datastore, a per-batch-size schedule, sampled drafts
            "default": {"method": "falcon", "model": drafter, "num_speculative_tokens": 4, "falcon_tokens": 2,
                        "lookup_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 3, "datastore": datastore,
                        "num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 1 << 20, 0]],
                        "draft_sample_method": "probabilistic", "draft_temperature_scale": 0.6}}[mode]


def main():
    target, drafter, mode, ranks = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    tp, pp = (1, int(ranks[2:])) if ranks.startswith("pp") else (int(ranks), 1)  # "2": TP=2; "pp2": PP=2
    datastore = sys.argv[5] if len(sys.argv) > 5 else None
    from vllm import LLM, SamplingParams

    from falcon_vllm.vllm.engine import spec_counters

    llm = LLM(model=target, dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=4,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, speculative_config=spec_config(mode, drafter, datastore),
              disable_log_stats=False, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    counters = spec_counters(llm)
    # sampled drafts as well: a sampled request beside a seeded one, then the seeded one alone
    beside = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                 [SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True),
                  SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)], use_tqdm=False)
    seeded = llm.generate([{"prompt_token_ids": PROMPTS[1]}],
                          SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True), use_tqdm=False)
    print("TP_RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                     "seeded": list(seeded[0].outputs[0].token_ids),
                                     "seeded_beside": list(beside[1].outputs[0].token_ids), "counters": counters}),
          flush=True)
    os._exit(0)  # skip the executor's slow teardown (the test kills the worker processes left behind)


if __name__ == "__main__":
    main()
