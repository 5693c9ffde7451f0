"""The target's states captured inside vLLM (``gen-data --featurizer vllm``) against the transformers path, on a
tiny random fp32 Llama: the combined answer + featurize pass and the prefill-only pass.

Tolerance: the captured fp32 states equal transformers' fp32 states within 1e-4 (absolute; the states are of
order 1 to 4, the measured gap is about 1e-6); stored in the shards as bf16, within one bf16 rounding step
(2e-2 at these magnitudes).  The combined pass's last row of each conversation is zero: the answer's last
token is never fed to the model (``falcon_vllm.train.vllm_data``)."""

import json

import pytest
import torch

from tests.vllm_util import save_target  # noqa: I001 (sets the in-process engine's environment first)
from falcon_vllm.testing import tiny_llama
from falcon_vllm.train.answer_files import answers_meta
from falcon_vllm.train.gen_data import load_shards

AUX = (2, 1)  # out of order on purpose: the data keeps the order asked for
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tiny_llama(vocab=49152, hidden=64, layers=3, heads=2, kv_heads=1, seed=5)
    return model, save_target(model, str(tmp_path_factory.mktemp("capture") / "tiny"))


@torch.inference_mode()
def _hf_states(model, seq):
    """transformers' fp32 states of ``seq`` as gen-data's HF path computes them (before its bf16 rounding)."""
    o = model.base_model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    return torch.cat([o.last_hidden_state[0]] + [o.hidden_states[i][0] for i in AUX], -1)


def test_captured_states_equal_transformers_with_chunked_prefill_and_preemption(tiny):
    """Prompts longer than a step's token budget (chunked prefill: a prompt's rows arrive over several steps) and a
    KV cache of 3 blocks for 6 requests (preemption: requests computed again from the start): every captured row
    equals transformers' fp32 row, in the combined pass and in the prefill-only pass."""
    from falcon_vllm.vllm.capture import CaptureEngine

    model, path = tiny
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 49000, (n,), generator=g).tolist() for n in (5, 90, 33, 150, 100, 120)]
    eng = CaptureEngine(path, 256, 8, dtype="float32", aux_layers=AUX, max_num_batched_tokens=64,
                        num_gpu_blocks_override=3)
    try:
        answers = eng(prompts, 40)
        seqs = [p + a for p, a in zip(prompts, answers)]
        assert eng.rows > sum(len(s) - 1 for s in seqs)  # some rows were computed twice: preempted requests
        for s in seqs:
            got, ref = eng.take(s), _hf_states(model, s)
            assert got.shape == ref.shape == (len(s), 3 * 64)
            assert (got[:-1] - ref[:-1]).abs().max() < ATOL and not got[-1].any()
        eng.forget()
        eng.featurize(seqs)
        for s in seqs:
            assert (eng.take(s) - _hf_states(model, s)).abs().max() < ATOL
    finally:
        eng.close()


def test_gen_data_featurizer_vllm_agrees_with_the_transformers_shards(tiny, tmp_path):
    """gen-data --featurizer vllm answers and featurizes in one pass; the same answers featurized by transformers
    (--answers, --featurizer hf) and by a prefill through vLLM (--answers, --featurizer vllm) give the same shards
    within bf16 rounding; the manifest records the featurizer and its dtype; a resume with another refuses."""
    from falcon_vllm.train import gen_data

    model, path = tiny
    convs = [{"conversations": [{"from": "human", "value": f"question {i} " * (1 + i % 4)},
                                {"from": "gpt", "value": "a"}]} for i in range(5)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    kw = dict(data=str(tmp_path / "sg.json"), shard_size=3, backend="vllm", aux_layers=AUX)
    ans = str(tmp_path / "answers.safetensors")
    one = gen_data.run(path, str(tmp_path / "one"), 5, 10, featurizer="vllm", featurize_dtype="float32",
                       save_answers_to=ans, **kw)
    hf = gen_data.run(path, str(tmp_path / "hf"), 5, 10, answers=ans, model=model, **kw)
    pre = gen_data.run(path, str(tmp_path / "pre"), 5, 10, answers=ans, featurizer="vllm",
                       featurize_dtype="float32", **kw)
    man = json.loads((one / "manifest.json").read_text())
    assert (man["featurizer"], man["featurize_dtype"], man["aux_layers"]) == ("vllm", "float32", list(AUX))
    assert sum(sh["last_row_zero"] for sh in man["shards"]) == 5
    assert json.loads((hf / "manifest.json").read_text())["featurizer"] == "hf"
    a, b, c = (load_shards(str(d)) for d in (one, hf, pre))
    assert len(a) == len(b) == len(c) == 5
    for x, y, z in zip(a, b, c):
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.loss_mask, y.loss_mask) and x.loss_mask.any()
        assert x.aux_width == y.aux_width == z.aux_width == 128
        bf16_step = 2e-2 * y.features.float().abs().clamp(min=1)
        assert ((x.features[:-1].float() - y.features[:-1].float()).abs() <= bf16_step[:-1]).all()
        assert not x.features[-1].any()
        assert ((z.features.float() - y.features.float()).abs() <= bf16_step).all()
    with pytest.raises(ValueError, match="other --featurizer"):
        gen_data.run(path, str(one), 5, 10, answers=ans, model=model, **kw)
    # features rebuilt from part of an answers file that the same run saves to: the file is not shrunk
    gen_data.run(path, str(tmp_path / "part"), 3, 10, answers=ans, model=model, save_answers_to=ans, **kw)
    assert answers_meta(ans)["conversations"] == "5"


def test_answers_only_with_out_keeps_the_states_a_later_run_reuses(tiny, tmp_path):
    """gen-data --answers-only FILE --out DIR: each shard it answers from the shard's first conversation on is written
    with the states captured while answering (a shard begun part-way keeps none); a later --answers FILE run into
    DIR featurizes only the rest (the shards missing or holding fewer conversations, by a prefill through vLLM),
    and every state equals transformers' fp32 state of the stored answer."""
    from falcon_vllm.train import gen_data, grow
    from falcon_vllm.train.answer_files import load_answers

    model, path = tiny
    convs = [{"conversations": [{"from": "human", "value": f"ask {i} " * (1 + i % 3)},
                                {"from": "gpt", "value": "a"}]} for i in range(5)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    ans, out, data = str(tmp_path / "answers.safetensors"), tmp_path / "out", str(tmp_path / "sg.json")
    kw = dict(data=data, out_dir=str(out), featurize_dtype="float32")
    assert grow.answers_only(path, ans, 1, 10, 2, **kw) == 1  # shard 0, one conversation of two
    assert grow.answers_only(path, ans, 5, 10, 2, **kw) == 5  # conversation 1 (part of shard 0), shards 1 and 2
    man = json.loads((out / "manifest.json").read_text())
    assert [(sh["file"], sh["conversations"], sh["last_row_zero"]) for sh in man["shards"]] == [
        ("shard_00000.safetensors", 1, 1), ("shard_00001.safetensors", 2, 2), ("shard_00002.safetensors", 1, 1)]
    assert (man["featurizer"], man["featurize_dtype"]) == ("vllm", "float32")
    kept = (out / "shard_00001.safetensors").read_bytes()
    with pytest.raises(ValueError, match="other --featurize-dtype"):
        grow.answers_only(path, ans, 5, 10, 2, **{**kw, "featurize_dtype": "bfloat16"})
    gen_data.run(path, str(out), 5, 10, shard_size=2, data=data, backend="vllm", answers=ans, featurizer="vllm",
                 featurize_dtype="float32")
    man = json.loads((out / "manifest.json").read_text())
    assert [(sh["conversations"], sh.get("from_answers", False)) for sh in man["shards"]] == [
        (2, True), (2, False), (1, False)]
    assert (out / "shard_00001.safetensors").read_bytes() == kept  # not featurized again
    stored, shards = load_answers(ans, {**answers_meta(ans), "max_turns": 1})[0], load_shards(str(out))
    assert len(shards) == 5
    for i, (x, (q, m)) in enumerate(zip(shards, stored)):
        assert x.tokens.tolist() == q and x.loss_mask.tolist() == [bool(b) for b in m] and any(m)
        with torch.inference_mode():
            ref = model.base_model(input_ids=torch.tensor([q])).last_hidden_state[0]
        rows = len(q) - (1 if i >= 2 else 0)  # the combined pass never computes an answer's last row
        assert ((x.features[:rows].float() - ref[:rows]).abs() <= 2e-2 * ref[:rows].abs().clamp(min=1)).all()
        assert i < 2 or not x.features[-1].any()


def test_answers_only_continuing_first_turns_keeps_the_states_of_the_whole_conversation(tiny, tmp_path):
    """gen-data --answers-only OUT --answers FIRST --max-turns 2 --loss-from-turn 2 --out DIR: the second answers are
    generated with the states captured, the first turn as context (loss 0); a conversation without a second
    question is featurized by a prefill; every state equals transformers' fp32 state of the stored tokens."""
    from falcon_vllm.train import grow
    from falcon_vllm.train.answer_files import load_answers

    model, path = tiny
    convs = [{"conversations": [{"from": "human", "value": f"ask {i} "}, {"from": "gpt", "value": "a"}]
              + ([{"from": "human", "value": f"and {i} " * 2}, {"from": "gpt", "value": "b"}] if i else [])}
             for i in range(3)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    first, second, out = str(tmp_path / "first.safetensors"), str(tmp_path / "second.safetensors"), tmp_path / "out"
    data = str(tmp_path / "sg.json")
    assert grow.answers_only(path, first, 3, 10, 4, data=data) == 3
    assert grow.answers_only(path, second, 3, 10, 4, data=data, out_dir=str(out), featurize_dtype="float32",
                             continues=first, max_turns=2, loss_from_turn=2) == 3
    man = json.loads((out / "manifest.json").read_text())
    assert (man["max_turns"], man["loss_from_turn"], man["shards"][0]["last_row_zero"]) == (2, 2, 2)
    shards, one = load_shards(str(out)), load_answers(first, answers_meta(first))[0]
    assert len(shards) == 3
    for i, (x, (q, _)) in enumerate(zip(shards, one)):
        assert x.tokens.tolist()[:len(q)] == q and not x.loss_mask[:len(q)].any()
        assert bool(x.loss_mask.any()) == bool(i) and (len(x.tokens) > len(q)) == bool(i)
        with torch.inference_mode():
            ref = model.base_model(input_ids=x.tokens[None]).last_hidden_state[0]
        rows = len(x.tokens) - (1 if i else 0)  # a generated answer's last row is never computed
        assert ((x.features[:rows].float() - ref[:rows]).abs() <= 2e-2 * ref[:rows].abs().clamp(min=1)).all()
