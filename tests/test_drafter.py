import os
from dataclasses import replace

import pytest
import torch

from falcon_vllm.config import FalconConfig
from falcon_vllm.convert import convert_official, export_official
from falcon_vllm.drafter import FalconDrafter, causal_context_mask, chunk_mask, level_order
from falcon_vllm.reference import DrafterCache, FalconReferenceEngine
from falcon_vllm.testing import random_drafter, tiny_llama

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def test_chunk_mask_end_aligned():
    m = chunk_mask(2, 5, 2)
    assert m[:, :2].all()  # the whole past is visible
    inner = m[:, 2:].int().tolist()
    # blocks [0], [1,2], [3,4]: the last k positions always form one block
    assert inner == [[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert chunk_mask(0, 3, 1).int().tolist() == torch.tril(torch.ones(3, 3)).int().tolist()


@pytest.mark.parametrize("fusion,layers", [("lstm", 1), ("fc", 2)])
def test_save_load_roundtrip(tmp_path, target, fusion, layers):
    d = random_drafter(target, k=2, fusion=fusion, num_layers=layers)
    d.save_pretrained(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    e = FalconDrafter.from_pretrained(str(tmp_path), target.config)
    for (n1, p1), (n2, p2) in zip(d.state_dict().items(), e.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert not any("embed" in n or "lm_head" in n for n in e.state_dict())  # shared, not stored


def test_tree_pass_blocks_equal_sequential_recompute(target):
    """Each SAR tree-pass block equals a fresh forward of that block on top of its ancestor chain."""
    d = random_drafter(target, k=2, fusion="lstm", num_layers=2)
    eng = FalconReferenceEngine(target, d, "falcon-llama")
    tree = eng.tree
    tokens = [3, 17, 9, 44, 5, 61, 2, 8, 30]          # 8 committed + pending
    with torch.inference_mode():
        feats = target.base_model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state[0]
        st = DrafterCache(2)
        node_tokens, outs = eng._draft(st, tokens, feats, return_outputs=True)
        n, k = feats.shape[0], 2
        checked = 0
        for q in range(1, tree.num_passes):
            plan = tree.passes[q]
            for b in range(plan.num_blocks):
                # the chain of expansion nodes e_1..e_q leading to this block
                e = tree.nodes[plan.expansion_slots[b] - 1]
                past = [(K.clone(), V.clone()) for K, V in st.kv]
                feat_in = outs[0]                      # the chunk block's outputs
                for i in range(1, q + 1):
                    ids = torch.tensor([node_tokens[tree.slot_of(e[:lvl]) - 1] for lvl in range(k * (i - 1) + 1, k * i + 1)])
                    pos = (n + k * (i - 1) + torch.arange(k))[None]
                    mask = torch.ones(k, past[0][0].shape[2] + k, dtype=torch.bool)
                    out, kv = d(d.embed(ids[None]), feat_in[None], pos, mask, past)
                    past = [(torch.cat([K, nk], 2), torch.cat([V, nv], 2)) for (K, V), (nk, nv) in zip(past, kv)]
                    feat_in = out[0]
                torch.testing.assert_close(outs[q][b * k:(b + 1) * k], feat_in, rtol=1e-5, atol=1e-5)
                checked += 1
    assert checked == sum(p.num_blocks for p in tree.passes[1:]) == 6 + 7 + 7


def _official_state(cfg: FalconConfig, qwen: bool, seed=0):
    """A state dict in the official Falcon key layout and shapes (cnets.py::Model)."""
    g = torch.Generator().manual_seed(seed)
    H, I = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    sd = {"embed_tokens.weight": r(cfg.vocab_size, H)}
    for l, inp in ((0, 2 * H), (1, H)):
        sd |= {f"lstm.weight_ih_l{l}": r(4 * H, inp), f"lstm.weight_hh_l{l}": r(4 * H, H),
               f"lstm.bias_ih_l{l}": r(4 * H), f"lstm.bias_hh_l{l}": r(4 * H)}
    p = "layers.0."
    sd |= {p + "self_attn.q_proj.weight": r(qd, H), p + "self_attn.k_proj.weight": r(kvd, H),
           p + "self_attn.v_proj.weight": r(kvd, H), p + "self_attn.o_proj.weight": r(H, qd),
           p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
           p + "mlp.down_proj.weight": r(H, I), p + "post_attention_layernorm.weight": 1 + r(H)}
    if qwen:
        sd |= {p + "self_attn.q_proj.bias": r(qd), p + "self_attn.k_proj.bias": r(kvd),
               p + "self_attn.v_proj.bias": r(kvd)}
    return sd


@pytest.mark.parametrize("qwen", [False, True])
def test_official_checkpoint_conversion_roundtrips(tmp_path, qwen):
    tgt = tiny_llama(qwen2=qwen)
    cfg = FalconConfig.from_target(tgt.config, k=2, fusion="lstm")
    sd = _official_state(cfg, qwen)
    src = tmp_path / "official"
    src.mkdir()
    torch.save(sd, src / "pytorch_model.bin")
    off_cfg = {**tgt.config.to_dict(), "num_hidden_layers": 1, "k_mask": 2}
    (src / "config.json").write_text(__import__("json").dumps(off_cfg, default=str))
    out = tmp_path / "ours"
    convert_official(str(src), str(out), tgt.config)
    d = FalconDrafter.from_pretrained(str(out), tgt.config)
    assert d.config.k == 2 and d.config.fusion == "lstm" and d.config.attention_bias == qwen
    back = export_official(d, sd["embed_tokens.weight"])
    assert sorted(back) == sorted(sd)
    for name in sd:
        assert torch.equal(back[name], sd[name]), name
    # what is not an official drafter checkpoint: one clear error each
    torch.save({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, tmp_path / "target.bin")
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    for src, err in [(tmp_path / "target.bin", r"no drafter layers \(layers.N.\*\)"),
                     (tmp_path / "cut.safetensors", "cut.safetensors cannot be read"),
                     (tmp_path / "missing", "--src .*missing: no such file")]:
        with pytest.raises((ValueError, FileNotFoundError), match=err):
            convert_official(str(src), str(tmp_path / "bad"), tgt.config)


def test_lstm_is_positionwise_from_zero_state(target):
    """Official semantics: each position's LSTM output ignores the other positions."""
    d = random_drafter(target, k=2, fusion="lstm")
    x = torch.randn(1, 5, 2 * d.config.hidden_size)
    full = d.lstm(x)
    for j in range(5):
        torch.testing.assert_close(full[:, j], d.lstm(x[:, j:j + 1])[:, 0])


def test_wrong_target_and_bad_checkpoints(tmp_path, target):
    d = random_drafter(target, k=2)
    d.save_pretrained(str(tmp_path / "ok"))
    other = tiny_llama(hidden=32, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="another target: hidden size 64 != target's 32"):
        FalconDrafter.from_pretrained(str(tmp_path / "ok"), other.config)
    with pytest.raises(ValueError, match="vocabulary 128 != target's 96"):
        FalconDrafter.from_pretrained(str(tmp_path / "ok"), tiny_llama(vocab=96).config)
    # not a drafter directory
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="not a Falcon drafter config"):
        FalconDrafter.from_pretrained(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="has no config.json"):
        FalconDrafter.from_pretrained(str(tmp_path))
    # missing weights
    (tmp_path / "noweights").mkdir()
    d.config.save(str(tmp_path / "noweights"))
    with pytest.raises(FileNotFoundError, match="has no weights"):
        FalconDrafter.from_pretrained(str(tmp_path / "noweights"))
    # corrupt weights
    (tmp_path / "corrupt").mkdir()
    d.config.save(str(tmp_path / "corrupt"))
    data = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        FalconDrafter.from_pretrained(str(tmp_path / "corrupt"))
    # weights of another shape under a valid config
    (tmp_path / "shape").mkdir()
    cfg2 = FalconConfig.from_hf_dict(d.config.to_hf_dict())
    cfg2.intermediate_size = 64
    cfg2.save(str(tmp_path / "shape"))
    os.link(tmp_path / "ok" / "model.safetensors", tmp_path / "shape" / "model.safetensors")
    with pytest.raises(ValueError, match="wrong shapes"):
        FalconDrafter.from_pretrained(str(tmp_path / "shape"))


def test_level_order():
    # blocks end at each row's length; a partial first block and the padding stay in place
    assert level_order(2, 7, 2, torch.tensor([7, 5])).tolist() == [[0, 2, 1, 4, 3, 6, 5], [0, 2, 1, 4, 3, 5, 6]]
    assert level_order(1, 6, 3).tolist() == [[2, 1, 0, 5, 4, 3]]
    idx = level_order(3, 11, 3, torch.tensor([11, 8, 2]))
    assert torch.equal(idx.gather(1, idx), torch.arange(11).expand(3, 11))   # its own inverse
    assert level_order(1, 4, 1).tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("k", [2, 3])
def test_reversed_block_order(tmp_path, target, k):
    """A reversed drafter is the same network whose rows come out mirrored inside each end-aligned block:
    level 1 from the block's last row.  Saved and loaded with its order; the forward order is the default."""
    fwd = random_drafter(target, k=k, fusion="fc", num_layers=2, seed=7)
    rev = random_drafter(target, k=k, fusion="fc", num_layers=2, seed=7, block_order="reversed")
    assert fwd.config.block_order == "forward" and "block_order" not in fwd.config.to_hf_dict()["falcon"]
    rev.save_pretrained(str(tmp_path))
    rev = FalconDrafter.from_pretrained(str(tmp_path), target.config)
    assert rev.config.block_order == "reversed"
    g = torch.Generator().manual_seed(0)
    B, T, H = 2, 9, target.config.hidden_size
    emb, feats = torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)
    pos = torch.arange(T).expand(B, T)
    lengths = torch.tensor([9, 6])
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b, L in enumerate(lengths.tolist()):
        mask[b] = torch.eye(T, dtype=torch.bool)
        mask[b, :L, :L] = chunk_mask(0, L, k)
    with torch.no_grad():
        a, kv_a = fwd(emb, feats, pos, mask, lengths=lengths)
        b_, kv_b = rev(emb, feats, pos, mask, lengths=lengths)
    for L, x, y in zip(lengths.tolist(), a, b_):
        first = L % k                                            # rows of the partial first block stay
        assert torch.allclose(y[:first], x[:first], atol=1e-6)
        for s in range(first, L, k):                             # every full block is mirrored
            assert torch.allclose(y[s:s + k], x[s:s + k].flip(0), atol=1e-6)
        assert not torch.allclose(y[first:L], x[first:L], atol=1e-3)
    assert all(torch.equal(p, q) for (p, _), (q, _) in zip(kv_a, kv_b))     # the KV does not change



def test_level_embedding(tmp_path, target):
    """A level embedding adds one learned vector per block row (its offset inside the end-aligned k-block) to the
    fused input.  It starts at zero (the drafter without it), is saved and loaded with the drafter, and a row's
    vector follows its offset: padding moves the blocks, and with them the vectors."""
    k, H = 2, target.config.hidden_size
    plain = random_drafter(target, k=k, fusion="fc", seed=7, block_order="reversed")
    lev = FalconDrafter(replace(plain.config, level_embedding=True)).eval()
    assert lev.level_emb.shape == (k, H) and not lev.level_emb.any()
    lev.load_state_dict({**plain.state_dict(), "level_emb": lev.level_emb.detach()})
    g = torch.Generator().manual_seed(0)
    T = 7
    emb, feats, pos = torch.randn(1, T, H, generator=g), torch.randn(1, T, H, generator=g), torch.arange(T)[None]
    with torch.no_grad():
        torch.testing.assert_close(lev(emb, feats, pos, chunk_mask(0, T, k))[0],
                                   plain(emb, feats, pos, chunk_mask(0, T, k))[0])
        lev.level_emb.normal_(generator=g)
    lev.save_pretrained(str(tmp_path))
    assert lev.config.to_hf_dict()["falcon"]["level_embedding"] is True
    assert "level_embedding" not in plain.config.to_hf_dict()["falcon"]
    back = FalconDrafter.from_pretrained(str(tmp_path), target.config)
    assert back.config.level_embedding and torch.equal(back.level_emb, lev.level_emb)
    # row j of a row of length L gets the vector of offset (j - L) mod k: 1 (the last) for a partial first block
    lengths = torch.tensor([T, 6])
    emb2, feats2, pos2 = emb.expand(2, T, H), feats.expand(2, T, H), pos.expand(2, T)
    mask = torch.stack([chunk_mask(0, T, k)] + [torch.eye(T, dtype=torch.bool)])
    mask[1, :6, :6] = chunk_mask(0, 6, k)
    offsets = torch.tensor([[1, 0, 1, 0, 1, 0, 1], [0, 1, 0, 1, 0, 1, 0]])  # row 1's last: padding
    orig = plain.fuse
    plain.fuse = lambda e, f: orig(e, f) + back.level_emb[offsets]
    with torch.no_grad():
        got = back(emb2, feats2, pos2, mask, lengths=lengths)[0]
        want = plain(emb2, feats2, pos2, mask, lengths=lengths)[0]
        plain.fuse = orig
        without = plain(emb2, feats2, pos2, mask, lengths=lengths)[0]
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1, :6], want[1, :6])
    assert not torch.allclose(got[0], without[0], atol=1e-3)                 # the vectors are used


@pytest.mark.parametrize("L", [7, 8])
def test_causal_context_mask_is_servings_first_pass(target, L):
    """Fed [block copy ; causal copy] under causal_context_mask, every block's outputs are serving's first pass at
    that block: a causal pass over the positions before it, then the block alone (relaxed) on that K/V.  With one
    layer that is the training forward's output too; with two it is not (the earlier positions' K/V differ)."""
    k = 2
    g = torch.Generator().manual_seed(1)
    H = target.config.hidden_size
    emb, feats = torch.randn(1, L, H, generator=g), torch.randn(1, L, H, generator=g)
    pos = torch.arange(L)[None]
    m = causal_context_mask(L, k)
    assert m.shape == (2 * L, 2 * L) and not m[L:, :L].any()                 # the causal copy never sees blocks
    for layers in (1, 2):
        d = random_drafter(target, k=k, fusion="fc", num_layers=layers, seed=3, block_order="reversed")
        with torch.no_grad():
            two = d(emb.repeat(1, 2, 1), feats.repeat(1, 2, 1), pos.repeat(1, 2), m[None],
                    lengths=torch.tensor([L]))[0][0, :L]
            relaxed = d(emb, feats, pos, chunk_mask(0, L, k))[0][0]
            r = L % k                                                         # a partial first block
            for start, end in ([(0, r)] if r else []) + [(b, b + k) for b in range(r, L, k)]:
                past = None
                if start:
                    _, past = d(emb[:, :start], feats[:, :start], pos[:, :start], chunk_mask(0, start, 1))
                out, _ = d(emb[:, start:end], feats[:, start:end], pos[:, start:end], chunk_mask(start, end - start, k),
                           past=past, lengths=torch.tensor([end - start]))
                torch.testing.assert_close(two[start:end], out[0], atol=1e-5, rtol=1e-5)
        if layers == 1:
            torch.testing.assert_close(two, relaxed, atol=1e-5, rtol=1e-5)
        else:
            assert not torch.allclose(two, relaxed, atol=1e-3)                  # the earlier positions' K/V differ


def test_config_validation():
    with pytest.raises(ValueError, match="block_order"):
        FalconConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                     vocab_size=10, block_order="backwards")
    with pytest.raises(ValueError, match="fusion"):
        FalconConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                     vocab_size=10, fusion="gru")
    with pytest.raises(ValueError, match="k \\(tokens per drafter pass\\)"):
        FalconConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                     vocab_size=10, k=0)
    good = FalconConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                        vocab_size=10).to_hf_dict()
    assert FalconConfig.from_hf_dict(good).k == 2
    # a config.json with a value of the wrong type or out of bounds: one error naming the key, never a raw
    # ZeroDivisionError/TypeError, and never a value silently converted ("false" read as True, 2.7 as 2)
    for top, falcon, err in [({"num_key_value_heads": 0}, {}, "num_key_value_heads must be >= 1"),
                             ({"num_attention_heads": 0}, {}, "num_attention_heads must be >= 1"),
                             ({}, {"k": "two"}, "k must be an integer, got 'two'"),
                             ({}, {"k": 2.7}, "k must be an integer, got 2.7"),
                             ({}, {"level_embedding": "false"}, "level_embedding must be true or false"),
                             ({}, {"aux_layers": 5}, "aux_layers must be a list of integers"),
                             ({}, {"target": "llama"}, "target must be an object"),
                             ({"hidden_size": "64"}, {}, "hidden_size must be an integer")]:
        d = {**good, **top, "falcon": {**good["falcon"], **falcon}}
        with pytest.raises(ValueError, match=f"cfg.json: {err}"):
            FalconConfig.from_hf_dict(d, source="cfg.json")


def test_target_tensors_are_read_from_sharded_or_tied_safetensors(tmp_path):
    from safetensors.torch import save_file

    from falcon_vllm.drafter import EMBED_KEYS, target_head_rows, target_tensor

    emb, head = torch.randn(10, 4), torch.randn(10, 4)
    sharded, tied = tmp_path / "sharded", tmp_path / "tied"
    sharded.mkdir(), tied.mkdir()
    save_file({"model.embed_tokens.weight": emb}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"lm_head.weight": head, "model.norm.weight": torch.ones(4)},
              str(sharded / "model-00002-of-00002.safetensors"))
    save_file({"model.embed_tokens.weight": emb}, str(tied / "model.safetensors"))
    ids = torch.tensor([7, 0, 3])
    assert target_tensor(str(sharded), EMBED_KEYS)[0] == "model.embed_tokens.weight"
    assert torch.equal(target_tensor(str(sharded), EMBED_KEYS)[1], emb)
    assert torch.equal(target_head_rows(str(sharded), ids), head[ids])  # the head, not the embedding
    assert torch.equal(target_head_rows(str(tied), ids), emb[ids])  # tied: the embedding's rows
    with pytest.raises(ValueError, match="past the target's 10-row"):
        target_head_rows(str(tied), torch.tensor([10]))
    with pytest.raises(ValueError, match="frozen_head.*holds no safetensors file with lm_head.weight"):
        target_head_rows(str(tmp_path), ids)
