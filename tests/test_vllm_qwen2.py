"""falcon in vLLM on a Qwen2-shaped target (q/k/v biases, tied embeddings, rope theta 1e6), as Qwen2.5 is, with a
drafter whose MLP is narrower than the target's: chain and tree mode give vanilla's greedy tokens, and their drafts
equal the reference engine's (CPU, eager, fp32)."""

import pytest
import torch

from tests.vllm_util import EngineCache, drafter_of, greedy, reference_drafts, save_target

from falcon_vllm.testing import random_drafter, tiny_llama, truncate_head
from falcon_vllm.train.trainer import export_vllm_eagle

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
    # an MLP narrower than the target's (what keeps a drafter for a wide target small)
    drafter = random_drafter(target, k=2, fusion="lstm", seed=3, intermediate_size=96)
    assert drafter.config.intermediate_size == 96 != target.config.intermediate_size
    assert drafter.config.attention_bias and drafter.config.model_type == "qwen2"
    assert drafter.config.rope_theta == 1e6
    drafter.save_pretrained(str(base / "drafter"))
    # a truncated head frozen at the tied target's rows: its checkpoint holds the d2t map, not the rows
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:4096]
    truncate_head(drafter, target, ids, frozen=True).save_pretrained(str(base / "frozen"))
    # the EAGLE-1 baseline as train --mode eagle exports it (k=1 fc, frozen truncated head, vLLM's EAGLE layout)
    eagle = truncate_head(random_drafter(target, k=1, fusion="fc", seed=5, intermediate_size=96), target, ids,
                          frozen=True)
    export_vllm_eagle(eagle, str(base / "eagle"))
    return {"dir": base, "target": target, "drafter": drafter, "frozen_ids": ids.sort().values}


@pytest.fixture(scope="module")
def engines(ckpts):
    base = ckpts["dir"]
    spec = lambda **kw: {"method": "falcon", "model": str(base / "drafter"), **kw}  # noqa: E731
    e = EngineCache({"vanilla": (str(base / "target"), None, {}),
                     "chain": (str(base / "target"), spec(num_speculative_tokens=4), {}),
                     "tree": (str(base / "target"), spec(tree="falcon-llama"), {}),
                     "frozen": (str(base / "target"), {"method": "falcon", "model": str(base / "frozen"),
                                                        "num_speculative_tokens": 4}, {}),
                     "eagle": (str(base / "target"), {"method": "eagle", "model": str(base / "eagle"),
                                                       "num_speculative_tokens": 3}, {})})
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


@pytest.mark.parametrize("mode,tree", [("chain", "chain-4"), ("tree", "falcon-llama"), ("frozen", "chain-4")])
def test_greedy_identity_and_reference_drafts(engines, ckpts, mode, tree):
    """frozen: a truncated head stored as its d2t map alone, its rows read from the target's checkpoint (vLLM)
    and taken from the target module (the reference engine)."""
    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.reference import FalconReferenceEngine

    want, _ = greedy(engines.get("vanilla"), PROMPTS, n=N)
    llm = engines.get(mode)
    prop = drafter_of(llm)
    (tokens, outs), log = _drafts_per_request(prop, lambda: greedy(llm, PROMPTS, n=N))
    assert tokens == want
    drafter = ckpts["drafter"] if mode != "frozen" else FalconDrafter.load(str(ckpts["dir"] / "frozen"))
    eng = FalconReferenceEngine(ckpts["target"], drafter, tree=tree)
    for p, toks, o in zip(PROMPTS, tokens, outs):
        ref_tokens, ref_drafts = reference_drafts(eng, p, N)
        assert ref_tokens == toks
        ours = log[o.request_id]
        n = min(len(ours), len(ref_drafts)) - 1  # the last round may be trimmed by max_tokens
        assert n >= 8 and ours[:n] == ref_drafts[:n], (mode, p)


def test_a_frozen_head_is_stored_as_its_d2t_map_and_read_from_the_target(ckpts):
    from safetensors import safe_open

    from falcon_vllm.drafter import FalconDrafter, target_head_rows

    base, target, ids = ckpts["dir"], ckpts["target"], ckpts["frozen_ids"]
    with safe_open(str(base / "frozen" / "model.safetensors"), "pt") as f:
        assert "d2t" in f.keys() and "lm_head.weight" not in f.keys()
    with safe_open(str(base / "target" / "model.safetensors"), "pt") as f:  # tied: the target stores no head
        assert "lm_head.weight" not in f.keys()
    rows = target_head_rows(str(base / "target"), ids)
    assert torch.equal(rows, target.lm_head.weight.detach()[ids])
    d = FalconDrafter.load(str(base / "frozen"))
    assert torch.equal(d.draft_ids, ids)
    d.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    assert torch.equal(d.lm_head.weight, rows) and not d.lm_head.weight.requires_grad


def test_eagle_baseline_on_a_qwen2_target(engines):
    """vLLM's EAGLE-1 proposer serving the exported baseline (its one layer indexed past the target's layers,
    whose layer_types it shares): vanilla's greedy tokens."""
    want, _ = greedy(engines.get("vanilla"), PROMPTS, n=N)
    got, _ = greedy(engines.get("eagle"), PROMPTS, n=N)
    assert got == want
