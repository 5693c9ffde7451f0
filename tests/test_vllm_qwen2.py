"""falcon in vLLM on a Qwen2-shaped target (q/k/v biases, tied embeddings, rope theta 1e6), as Qwen2.5 is: chain
and tree mode give vanilla's greedy tokens, and their drafts equal the reference engine's (CPU, eager, fp32)."""

import pytest

from tests.vllm_util import EngineCache, drafter_of, greedy, reference_drafts, save_target

from falcon_vllm.testing import random_drafter, tiny_llama

V = 49152
PROMPTS = [[11, 12, 13], list(range(200, 237)), list(range(1000, 1020))]
N = 20


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("qwen2")
    target = tiny_llama(vocab=V, hidden=64, heads=2, kv_heads=1, seed=7, qwen2=True, tied=True)
    assert target.config.tie_word_embeddings and target.lm_head.weight is target.model.embed_tokens.weight
    assert float(target.model.layers[0].self_attn.q_proj.bias.detach().abs().sum()) > 0
    save_target(target, str(base / "target"))
    drafter = random_drafter(target, k=2, fusion="lstm", seed=3)
    assert drafter.config.attention_bias and drafter.config.model_type == "qwen2"
    assert drafter.config.rope_theta == 1e6
    drafter.save_pretrained(str(base / "drafter"))
    return {"dir": base, "target": target, "drafter": drafter}


@pytest.fixture(scope="module")
def engines(ckpts):
    base = ckpts["dir"]
    spec = lambda **kw: {"method": "falcon", "model": str(base / "drafter"), **kw}  # noqa: E731
    e = EngineCache({"vanilla": (str(base / "target"), None, {}),
                     "chain": (str(base / "target"), spec(num_speculative_tokens=4), {}),
                     "tree": (str(base / "target"), spec(tree="falcon-llama"), {})})
    yield e
    e.close()


def _drafts_per_request(prop, run):
    """Run ``run()`` with ``prop.propose`` recording each step's drafts per request id; -> (run's result, log)."""
    log, orig = {}, prop.propose

    def propose(*a, **kw):
        out = orig(*a, **kw)
        for rid, row in zip(prop._runner.input_batch.req_ids, out.tolist()):
            log.setdefault(rid.rsplit("-", 1)[0], []).append(row)  # internal id: external-xxx
        return out

    prop.propose = propose
    try:
        return run(), log
    finally:
        del prop.propose


@pytest.mark.parametrize("mode,tree", [("chain", "chain-4"), ("tree", "falcon-llama")])
def test_greedy_identity_and_reference_drafts(engines, ckpts, mode, tree):
    from falcon_vllm.reference import FalconReferenceEngine

    want, _ = greedy(engines.get("vanilla"), PROMPTS, n=N)
    llm = engines.get(mode)
    prop = drafter_of(llm)
    (tokens, outs), log = _drafts_per_request(prop, lambda: greedy(llm, PROMPTS, n=N))
    assert tokens == want
    eng = FalconReferenceEngine(ckpts["target"], ckpts["drafter"], tree=tree)
    for p, toks, o in zip(PROMPTS, tokens, outs):
        ref_tokens, ref_drafts = reference_drafts(eng, p, N)
        assert ref_tokens == toks
        ours = log[o.request_id]
        n = min(len(ours), len(ref_drafts)) - 1  # the last round may be trimmed by max_tokens
        assert n >= 8 and ours[:n] == ref_drafts[:n], (mode, p)
