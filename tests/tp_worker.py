"""Run by tests/test_vllm_tp.py in a fresh process (vLLM spawns one worker per tensor-parallel rank):
greedy tokens and spec counters of one engine as JSON on stdout.  Args: target, drafter, mode, tp."""

import json
import os
import sys


def main():
    target, drafter, mode, tp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    from vllm import LLM, SamplingParams

    from falcon_vllm.vllm.engine import spec_counters

    spec = {"chain": {"method": "falcon", "model": drafter, "num_speculative_tokens": 3},
            "tree": {"method": "falcon", "model": drafter, "tree": "tree-3x2x1"}}.get(mode)
    llm = LLM(model=target, dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=4,
              tensor_parallel_size=tp, speculative_config=spec, disable_log_stats=False, seed=0)
    prompts = [[11, 12, 13], list(range(200, 237)), [5] * 9]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    print("TP_RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                     "counters": spec_counters(llm)}))
    os._exit(0)  # skip the executor's slow teardown


if __name__ == "__main__":
    main()
