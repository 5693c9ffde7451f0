"""falcon in vLLM's default torch.compile mode (CPU, in-process engine, no enforce_eager): what `vllm serve`
runs unless told --enforce-eager.  The target and the Falcon drafter are compiled (the drafter as vLLM's
``eagle_head``; on CPU); a drafter with a level embedding, whose per-pass row offsets are Python state, stays eager.

Each engine compiles on start-up (about half a minute for these tiny models), so this file builds four.
"""

import math
from contextlib import contextmanager

import pytest

from tests.vllm_util import counter_delta, drafter_of, greedy, make_llm, save_target, shutdown_llm, spec_counters

from falcon_vllm.testing import exact_drafter, increment_llama, random_drafter, tiny_llama

V = 49152
PROMPTS = [[11, 12, 13], list(range(200, 237)), [5] * 9, [7]]
PROMPTS_INC = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    rnd = tiny_llama(vocab=V, hidden=64, heads=2, kv_heads=1, seed=5)
    save_target(rnd, str(base / "rnd"))
    random_drafter(rnd, k=2, fusion="fc", num_layers=2, seed=3, block_order="reversed").save_pretrained(
        str(base / "rnd_fc2"))
    random_drafter(rnd, k=2, fusion="fc", seed=4, level_embedding=True).save_pretrained(str(base / "rnd_level"))
    inc = increment_llama(vocab=V, hidden=128, heads=2, kv_heads=1)  # greedy: t+1, t+2, ...
    save_target(inc, str(base / "inc"))
    exact_drafter(inc, k=2).save_pretrained(str(base / "exact_k2"))
    return base


@contextmanager
def _compiled_llm(target, spec=None):
    """A compiled in-process engine, shut down on leaving (one engine at a time)."""
    llm = make_llm(target, spec, enforce_eager=False,
                   **({} if spec is None else {"per_request_spec_decode_metrics": "detailed"}))
    try:
        yield llm
    finally:
        shutdown_llm(llm)


def _drafter_module(llm):
    from falcon_vllm.vllm.proposer import unwrap_model

    return unwrap_model(drafter_of(llm).model).model  # FalconDraftModel


def test_compiled_drafter_greedy_identical_to_vanilla(ckpts):
    with _compiled_llm(ckpts / "rnd") as llm:
        ref = greedy(llm, PROMPTS)[0]
    with _compiled_llm(ckpts / "rnd", {"method": "falcon", "model": str(ckpts / "rnd_fc2"),
                                       "num_speculative_tokens": 4}) as llm:
        prop = drafter_of(llm)
        mod = _drafter_module(llm)
        assert not mod.do_not_compile  # vLLM compiles it (as "eagle_head")
        before = spec_counters(llm)
        for p, r in zip(PROMPTS, ref):                                   # batch 1
            assert greedy(llm, [p])[0][0] == r, p
        assert greedy(llm, PROMPTS)[0] == ref                            # batch 4, mixed lengths
        d = counter_delta(spec_counters(llm), before)
        assert d["num_drafts"] > 0 and d["num_draft_tokens"] == 4 * d["num_drafts"]
        assert mod.compiled and prop.passes == prop.steps * math.ceil(4 / prop.k)


def test_compiled_exact_drafter_accepts_everything(ckpts):
    """The compiled drafter computes what the eager one does: a perfect drafter's every draft is accepted."""
    with _compiled_llm(ckpts / "inc", {"method": "falcon", "model": str(ckpts / "exact_k2"),
                                       "num_speculative_tokens": 5}) as llm:
        assert not _drafter_module(llm).do_not_compile
        before = spec_counters(llm)
        toks, _ = greedy(llm, PROMPTS_INC, n=30)
        for p, t in zip(PROMPTS_INC, toks):
            assert t == [(p[-1] + i) % V for i in range(1, 31)]
        c = counter_delta(spec_counters(llm), before)
        assert c["num_drafts"] > 0 and c["num_accepted_tokens"] == c["num_draft_tokens"] == 5 * c["num_drafts"]


def test_level_embedding_drafter_stays_eager(ckpts):
    with _compiled_llm(ckpts / "rnd", {"method": "falcon", "model": str(ckpts / "rnd_level"),
                                       "num_speculative_tokens": 2}) as llm:
        assert _drafter_module(llm).do_not_compile
        assert len(greedy(llm, PROMPTS[:2], n=8)[0][1]) == 8
