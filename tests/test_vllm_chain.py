"""falcon in vLLM, chain mode (CPU, in-process engine, eager, fp32)."""

import math

import pytest
import torch

from tests.vllm_util import drafter_of, free, make_llm, save_target, spec_counters

from falcon_vllm.testing import exact_drafter, increment_llama, random_drafter, tiny_llama

V = 49152


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    inc = increment_llama(vocab=V, hidden=128, heads=2, kv_heads=1)
    save_target(inc, str(base / "inc"))
    exact_drafter(inc, k=2).save_pretrained(str(base / "exact_k2"))
    exact_drafter(inc, k=3).save_pretrained(str(base / "exact_k3"))
    rnd = tiny_llama(vocab=V, hidden=64, heads=2, kv_heads=1, seed=5)
    save_target(rnd, str(base / "rnd"))
    random_drafter(rnd, k=2, fusion="lstm").save_pretrained(str(base / "rnd_lstm"))
    return base


PROMPTS_INC = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106], [9000, 9001, 9002]]  # prompts >= k tokens


@pytest.mark.parametrize("k,K", [(2, 5), (3, 4)])
def test_exact_drafter_accepts_everything(ckpts, k, K):
    from vllm import SamplingParams

    llm = make_llm(str(ckpts / "inc"), {"method": "falcon", "model": str(ckpts / f"exact_k{k}"),
                                        "num_speculative_tokens": K})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS_INC],
                            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        for p, o in zip(PROMPTS_INC, outs):
            assert list(o.outputs[0].token_ids) == [(p[-1] + i) % V for i in range(1, 31)]
        c = spec_counters(llm)
        assert c["num_drafts"] > 0 and c["num_accepted_tokens"] == c["num_draft_tokens"] == K * c["num_drafts"]
        assert 1 + c["num_accepted_tokens"] / c["num_drafts"] == K + 1   # mean acceptance length
        assert list(c["num_accepted_tokens_per_pos"]) == [c["num_drafts"]] * K
        prop = drafter_of(llm)
        assert type(prop).__name__ == "FalconProposer" and prop.falcon is not None
        assert prop.steps > 0 and prop.passes == prop.steps * math.ceil(K / k)  # counted, not assumed
    finally:
        free(llm)


def test_random_drafter_greedy_identical_to_vanilla(ckpts):
    from vllm import SamplingParams

    prompts = [[11, 12, 13], list(range(200, 237)), [5] * 9, list(range(1000, 1020))]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    van = make_llm(str(ckpts / "rnd"))
    ref = [list(o.outputs[0].token_ids) for o in van.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    free(van)
    llm = make_llm(str(ckpts / "rnd"), {"method": "falcon", "model": str(ckpts / "rnd_lstm"),
                                        "num_speculative_tokens": 4})
    try:
        got1 = [list(llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids) for p in prompts[:2]]
        assert got1 == ref[:2]                                            # batch 1
        got4 = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
        assert got4 == ref                                                # batch 4, mixed lengths
        assert spec_counters(llm)["num_drafts"] > 0
        # temperature > 0 runs through the same proposer and vLLM's lossless rejection sampler
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=1, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
        assert all(0 <= t < V for o in outs for t in o.outputs[0].token_ids)
        # per-request metrics report falcon's steps
        o = llm.generate([{"prompt_token_ids": prompts[0]}], sp)[0]
        assert o.outputs[0].token_ids
    finally:
        free(llm)
