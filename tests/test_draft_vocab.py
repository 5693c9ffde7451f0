"""Truncated draft vocabulary: the drafter's own N-token head with its d2t map (draft id -> target id).

Pure torch (checkpoint round-trip, refusals, training loss, the reference engine) and in vLLM: an exact
drafter whose head keeps only the tokens it must propose accepts every draft in chain mode, tree mode
and as vLLM's own EAGLE-1 (``EagleD2TLlamaForCausalLM``); a wrong map would make every draft miss.
"""

import math
import os

import pytest
import torch

from falcon_vllm.drafter import FalconDrafter
from falcon_vllm.reference import FalconReferenceEngine
from falcon_vllm.testing import exact_drafter, hf_greedy, increment_llama, random_drafter, tiny_llama, truncate_head

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=128, seed=2)


def test_roundtrip_and_mapping(tmp_path, target):
    ids = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:40]
    d = truncate_head(random_drafter(target, k=2, fusion="fc"), target, ids)
    assert d.lm_head.weight.shape == (40, 64) and d.config.draft_vocab_size == 40
    assert torch.equal(d.draft_ids, ids.sort().values)                      # sorted target ids
    assert torch.equal(d.lm_head.weight, target.lm_head.weight[ids.sort().values])
    t2d = d.target_to_draft()
    assert torch.equal(t2d[d.draft_ids], torch.arange(40)) and int((t2d >= 0).sum()) == 40
    d.save_pretrained(str(tmp_path), dtype=torch.bfloat16)                  # the map is not cast
    e = FalconDrafter.from_pretrained(str(tmp_path), target.config)
    assert e.d2t.dtype == torch.long and torch.equal(e.d2t, d.d2t)
    e.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    top = e.topk_tokens(torch.randn(5, 64), 3)
    assert top.shape == (5, 3) and torch.isin(top, ids).all()              # proposals are target ids


def _resave(directory, drop=(), **replace):
    from safetensors.torch import load_file, save_file

    f = os.path.join(directory, "model.safetensors")
    state = {k: v for k, v in load_file(f).items() if k not in drop}
    state.update(replace)
    save_file(state, f)


def test_missing_or_bad_map_is_refused(tmp_path, target):
    d = truncate_head(random_drafter(target, k=2, fusion="fc"), target, torch.arange(10, 50))
    for name, kw in {"dropped": {"drop": ("d2t",)},
                     "duplicate": {"d2t": torch.zeros(40, dtype=torch.long) - torch.arange(40) + 10},
                     "outside": {"d2t": torch.full((40,), 127, dtype=torch.long)},
                     "float": {"d2t": torch.zeros(40)}}.items():
        path = str(tmp_path / name)
        d.save_pretrained(path)
        _resave(path, **kw)
        with pytest.raises(ValueError, match="d2t"):
            FalconDrafter.from_pretrained(path, target.config)


def test_training_loss_ignores_tokens_outside_the_head(target):
    from falcon_vllm.train.losses import losses

    feats = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(1))
    batch = {"feat_lbl": feats}
    mask = torch.ones(1, 6, dtype=torch.bool)
    with torch.no_grad():
        teacher = target.lm_head(feats[0]).argmax(-1)
    d = truncate_head(random_drafter(target, k=2, fusion="fc"), target,
                      torch.cat([teacher, torch.arange(100, 128)]).unique())
    d.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    loss, parts = losses(d, feats.clone().requires_grad_(), batch, mask, w_dist=1.0, alpha=0.0)
    assert math.isfinite(float(loss.detach()))
    # CE counts only the teacher tokens the head can draft: with every teacher token outside it, CE is 0
    d2 = truncate_head(random_drafter(target, k=2, fusion="fc"), target,
                       torch.tensor([t for t in range(128) if t not in set(teacher.tolist())][:40]))
    d2.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    _, parts2 = losses(d2, feats, batch, mask, w_dist=1.0, alpha=0.0)
    assert parts2["ce"] == 0.0 and parts2["acc"] == 0.0 and parts["ce"] > 0


def test_reference_engine_greedy_identical_and_exact(target):
    d = truncate_head(random_drafter(target, k=2, fusion="fc"), target, torch.arange(20, 100))
    eng = FalconReferenceEngine(target, d, tree="falcon-llama")
    prompt = [3, 17, 40, 41]
    assert eng.generate(prompt, max_new_tokens=24).tokens == hf_greedy(target, prompt, 24)
    inc = increment_llama(vocab=128)
    exact = truncate_head(exact_drafter(inc, k=2), inc, torch.arange(0, 128, 2).tolist() + list(range(21, 60, 2)))
    res = FalconReferenceEngine(inc, exact, tree="chain-4").generate([20, 21], max_new_tokens=20)
    assert res.tokens == list(range(22, 42))
    assert res.tau == 5.0  # every draft accepted: the map sends each draft id to the right target id


# ---------------------------------------------------------------------- in vLLM
V = 49152
SHARP = 1000.0
INC_PROMPTS = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106], [9000, 9001, 9002]]
KEEP = list(range(0, 200)) + list(range(8990, 9100))  # every token the exact drafters must propose


@pytest.fixture(scope="module")
def vllm_ckpts(tmp_path_factory):
    pytest.importorskip("vllm")
    from tests.vllm_util import save_target

    from falcon_vllm.train.trainer import export_vllm_eagle

    base = tmp_path_factory.mktemp("d2t")
    inc = increment_llama(vocab=V, hidden=128, heads=2, kv_heads=1)
    with torch.no_grad():
        inc.lm_head.weight.mul_(SHARP)
    save_target(inc, str(base / "inc"))
    truncate_head(exact_drafter(inc, k=2), inc, KEEP).save_pretrained(str(base / "falcon_k2"))
    export_vllm_eagle(truncate_head(exact_drafter(inc, k=1), inc, KEEP), str(base / "eagle"))
    return base


@pytest.mark.parametrize("name", ["chain", "tree", "eagle"])
def test_vllm_truncated_head_accepts_everything(vllm_ckpts, name):
    from tests.vllm_util import counter_delta, drafter_of, greedy, make_llm, shutdown_llm, spec_counters

    base = vllm_ckpts
    spec = {"chain": {"method": "falcon", "model": str(base / "falcon_k2"), "num_speculative_tokens": 4},
            "tree": {"method": "falcon", "model": str(base / "falcon_k2"), "tree": "tree-3x2x1x1"},
            "eagle": {"method": "eagle", "model": str(base / "eagle"), "num_speculative_tokens": 3}}[name]
    llm = make_llm(str(base / "inc"), spec)
    try:
        if name != "eagle":
            assert unwrap(drafter_of(llm).model).truncated
        before = spec_counters(llm)
        toks, _ = greedy(llm, INC_PROMPTS, n=24)
        for p, t in zip(INC_PROMPTS, toks):
            assert t == [(p[-1] + i) % V for i in range(1, 25)]
        c = counter_delta(spec_counters(llm), before)
        depth = 4 if name != "eagle" else 3
        assert c["num_drafts"] > 0 and c["num_accepted_tokens"] == depth * c["num_drafts"]
    finally:
        shutdown_llm(llm)


def unwrap(model):
    while hasattr(model, "unwrap"):
        model = model.unwrap()
    return model
