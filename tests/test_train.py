"""Training pipeline on a tiny random target: data, glancing, a training step, resume, acceptance."""

import json
import os
import random
import time
from dataclasses import asdict, replace

import pytest
import torch

from falcon_vllm.drafter import FalconDrafter
from falcon_vllm.reference import FalconReferenceEngine
from falcon_vllm.testing import tiny_llama
from falcon_vllm.train.config import TrainConfig
from falcon_vllm.train.data import make_batch, phase_batch
from falcon_vllm.train.gen_data import Sample, generate_and_featurize, load_shards, write_shard
from falcon_vllm.train.losses import apply_glance, forward, glance_positions, losses
from falcon_vllm.train.sharegpt import iter_sharegpt
from falcon_vllm.train.trainer import train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=64, seed=3)


@pytest.fixture(scope="module")
def data(target):
    """The target's own greedy continuations of random prompts (what gen-data stores)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (4 + i % 3,), generator=g).tolist() for i in range(40)]
    out = []
    for b in range(0, 40, 8):
        out += generate_and_featurize(target, prompts[b:b + 8], 48, pad_id=0, eos_ids=set())
    return [Sample(s.tokens.long(), s.loss_mask.bool(), s.features) for s in out]


def test_sharegpt_parser_handles_truncated_file(tmp_path):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
             for i in range(3)]
    convs.insert(1, {"id": "x", "conversations": [{"from": "gpt", "value": "gpt first"}, {"from": "human", "value": "q"}]})
    text = json.dumps(convs)
    f = tmp_path / "sg.json"
    f.write_text(text[: len(text) - 30])  # cut inside the last conversation
    got = [c[0]["value"] for c in iter_sharegpt(str(f))]
    assert got == ["q0", "q1"]  # gpt-first dropped, truncated last one dropped
    # another format holds no ShareGPT conversation: said once the file is read, never a KeyError or 0 silently
    for other in ['{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}\n',  # JSONL
                  json.dumps([{"messages": [{"role": "user", "content": "q"}]}]),
                  json.dumps([{"conversations": [{"from": "human", "text": "q"}, {"from": "gpt", "text": "a"}]}]),
                  json.dumps([{"conversations": ["q", "a"]}])]:
        f.write_text(other)
        with pytest.raises(ValueError, match="no ShareGPT conversations in .*expected a JSON array"):
            list(iter_sharegpt(str(f)))


def test_gen_data_shapes_and_masks(tmp_path, target, data):
    prompt_lens = [4 + i % 3 for i in range(40)]
    for s, pl in zip(data, prompt_lens):
        assert s.features.dtype == torch.bfloat16 and s.features.shape == (len(s.tokens), 64)
        assert not s.loss_mask[:pl].any() and s.loss_mask[pl:].all()  # answer tokens only
    tok = data[0].tokens
    with torch.inference_mode():  # stored features are the target's post-norm last hidden states
        ref = target.base_model(input_ids=tok[None]).last_hidden_state[0]
    torch.testing.assert_close(data[0].features.float(), ref, atol=2e-2, rtol=2e-2)
    # greedy self-distillation: the answer is the target's greedy continuation
    from falcon_vllm.testing import hf_greedy
    assert tok[4:].tolist() == hf_greedy(target, tok[:4].tolist(), 48)
    write_shard(tmp_path / "shard_00000.safetensors",
                [Sample(s.tokens.int(), s.loss_mask.to(torch.uint8), s.features) for s in data[:5]])
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": [{"file": "shard_00000.safetensors"}]}))
    back = load_shards(str(tmp_path))
    assert len(back) == 5 and all(torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
                                  and torch.equal(a.features, b.features) for a, b in zip(back, data))


def test_glancing_replaces_exactly_what_it_claims(data):
    k = 2
    b = make_batch(data[:4], k, 64)
    pred = torch.randint(0, 64, b["lbl_ids"].shape)
    teacher = b["lbl_ids"].clone()
    pos = glance_positions(pred, teacher, b["loss"], k, 0.5, "uniform", random.Random(0))
    for i, p in enumerate(pos):
        m = b["loss"][i].nonzero().flatten()
        d = int((pred[i, m] != teacher[i, m]).sum())
        assert len(p) == min(int(0.5 * d), len(m[::k]))          # N = lambda * Hamming distance
        assert set(p.tolist()) <= set(m[::k].tolist())            # every k-th loss position
    ids, feats = apply_glance(b, pos)
    for i, p in enumerate(pos):
        other = torch.ones(ids.shape[1], dtype=torch.bool)
        other[p] = False
        assert torch.equal(ids[i, p], b["lbl_ids"][i, p]) and torch.equal(feats[i, p], b["feat_lbl"][i, p])
        assert torch.equal(ids[i, other], b["ids_in"][i, other]) and torch.equal(feats[i, other], b["feat_in"][i, other])
    err = glance_positions(pred, teacher, b["loss"], k, 1.0, "error", random.Random(0))
    for i, p in enumerate(err):
        assert (pred[i, p] != teacher[i, p]).all()                # error-driven picks mispredictions


def test_block_phase_trim_moves_block_levels(data):
    """A trim of t last positions keeps every remaining label and moves the end-aligned blocks by t, so a
    position that ended a block (level 1 in reversed order) starts one after a trim of 1 (k=2)."""
    k = 2
    a = make_batch(data[:3], k, 64)
    b = make_batch(data[:3], k, 64, trim=[1, 0, 1])
    assert b["lengths"].tolist() == [a["lengths"][0] - 1, a["lengths"][1], a["lengths"][2] - 1]
    for i in range(3):
        L = int(b["lengths"][i])
        for key in ("ids_in", "lbl_ids", "feat_in", "feat_lbl", "loss"):
            assert torch.equal(b[key][i, :L], a[key][i, :L])
        assert not b["loss"][i, L:].any()
        La = int(a["lengths"][i])
        ends_a = {j for j in range(La) if (La - 1 - j) % k == 0}
        ends_b = {j for j in range(L) if (L - 1 - j) % k == 0}
        # a block's last row sees its block-mate (relaxed mask); its first row sees it too
        for j in range(1, L):
            assert bool(b["attn"][i, j - 1, j]) == (j in ends_b)
        assert (ends_a & ends_b) == (set() if L != La else ends_a)
    # "both": every conversation once per trim, so every position ends a block (level 1) in exactly one copy
    both, trim = phase_batch(data[:3], TrainConfig("unused", k=k, block_phase="both"), random.Random(0))
    c = make_batch(both, k, 64, trim)
    assert c["lengths"].tolist() == [int(a["lengths"][i]) - t for i in range(3) for t in range(k)]
    for i in range(3):
        L0 = int(c["lengths"][2 * i])
        for key in ("ids_in", "lbl_ids", "feat_in", "feat_lbl", "loss"):
            assert torch.equal(c[key][2 * i, :L0], a[key][i, :L0])
        ends = [{j for j in range(L) if (L - 1 - j) % k == 0} for L in c["lengths"][2 * i:2 * i + 2].tolist()]
        assert all((j in ends[0]) != (j in ends[1]) for j in range(L0 - 1))
    with pytest.raises(ValueError, match="block_phase"):
        train(TrainConfig("unused", k=2, block_phase="rnadom"), samples=data, target=None)
    with pytest.raises(ValueError, match="token-loss weight"):
        train(TrainConfig("unused", k=2, w_dist=-0.1), samples=data, target=None)


def test_one_step_lowers_loss(target, data):
    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.config import FalconConfig
    torch.manual_seed(0)
    d = FalconDrafter(FalconConfig.from_target(target.config, k=2)).attach_target(
        target.get_input_embeddings(), target.get_output_embeddings())
    b = make_batch(data[:8], 2, 64)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    l0, _ = losses(d, forward(d, b["ids_in"], b["feat_in"], b), b, b["loss"], 0.1, 0.9)
    opt.zero_grad()
    l0.backward()
    opt.step()
    l1, _ = losses(d, forward(d, b["ids_in"], b["feat_in"], b), b, b["loss"], 0.1, 0.9)
    assert float(l1.detach()) < float(l0.detach())


def test_resume_is_exact(tmp_path, target, data):
    cfg = TrainConfig(str(tmp_path / "a"), k=2, epochs=2, batch_size=8, lr=1e-3, eval_every_epoch=False)
    kw = dict(samples=data, target=target, log=lambda *a: None)
    train(cfg, **kw)
    part = train(replace(cfg, out_dir=str(tmp_path / "b"), stop_after_epochs=1), **kw)
    assert part["stopped"] and part["state"]["epoch"] == 1
    train(replace(cfg, out_dir=str(tmp_path / "b")), **kw)         # resumes from checkpoint.pt
    ck = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert ck["config"] == asdict(replace(cfg, out_dir=str(tmp_path / "b"), tree="falcon-llama"))
    record = json.loads((tmp_path / "b" / "config.json").read_text())["falcon"]["extra"]["training"]
    assert record["lr"] == 1e-3 and record["steps"] == ck["state"]["step"] and "out_dir" not in record
    a = FalconDrafter.from_pretrained(str(tmp_path / "a")).state_dict()
    b = FalconDrafter.from_pretrained(str(tmp_path / "b")).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_train_refuses_what_it_cannot_train_on(tmp_path, target, data):
    """A checkpoint of a run with other settings or other data, or unreadable; data of another target's width; too few
    conversations to train on: one clear error each, before any step (never a hang or a silent change)."""
    cfg = TrainConfig(str(tmp_path / "a"), k=2, epochs=2, batch_size=8, lr=1e-3, eval_every_epoch=False)
    kw = dict(samples=data, target=target, log=lambda *a: None)
    train(replace(cfg, stop_after_epochs=1), **kw)
    for change, err in [(dict(lr=5e-4), "lr 0.001 -> 0.0005"), (dict(layers=2), "layers 1 -> 2"),
                        (dict(batch_size=4), "batch_size 8 -> 4")]:
        with pytest.raises(ValueError, match=f"a run with other settings \\(.*{err}.*--no-resume"):
            train(replace(cfg, **change), **kw)
    # other data (another --data, a set that grew): refused, with what the checkpoint's run trained on
    with pytest.raises(ValueError, match=r"a run on other data \(training: 38 conversations, \d+ tokens -> 37, "
                                         r"\d+; held out: .*--no-resume"):
        train(cfg, **{**kw, "samples": data[:39]})
    # how the run is kept, and the precision its steps compute in (a run moved to another machine), may change
    train(replace(cfg, checkpoint_minutes=5.0, eval_roots=10, bf16=True), **kw)
    (tmp_path / "a" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="checkpoint.pt cannot be read"):
        train(cfg, **kw)
    wide = [s._replace(features=torch.cat([s.features, s.features], 1)) for s in data]
    with pytest.raises(ValueError, match="holds states 128 wide, but the target's hidden size is 64"):
        train(replace(cfg, out_dir=str(tmp_path / "w")), **{**kw, "samples": wide})
    with pytest.raises(ValueError, match="the data holds 1 conversation"):
        train(replace(cfg, out_dir=str(tmp_path / "one")), **{**kw, "samples": data[:1]})


def test_a_run_stopped_within_an_epoch_resumes_exactly(tmp_path, target, data, monkeypatch):
    """checkpoint.pt is also written within an epoch (every --checkpoint-minutes; --stop-after-steps stops there):
    a run resumed from such a checkpoint trains the weights of the uninterrupted run."""
    from falcon_vllm.train import trainer

    cfg = TrainConfig(str(tmp_path / "a"), k=2, epochs=2, batch_size=8, lr=1e-3, eval_every_epoch=False)
    kw = dict(samples=data, target=target, log=lambda *a: None)
    saves = []
    real_save = trainer.save_checkpoint
    monkeypatch.setattr(trainer, "save_checkpoint", lambda run: (saves.append(run.state["step"]), real_save(run)))
    train(cfg, **kw)
    per_epoch = saves[0]
    assert per_epoch >= 3 and saves == [per_epoch, 2 * per_epoch]      # default 10 minutes: at the epochs' ends
    saves.clear()
    part = train(replace(cfg, out_dir=str(tmp_path / "b"), stop_after_steps=per_epoch + 1, checkpoint_minutes=0), **kw)
    assert part["stopped"] and part["state"] == {"step": per_epoch + 1, "epoch": 1, "history": []}
    assert saves == list(range(1, per_epoch + 2))                        # 0 minutes: after every step
    ck = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert ck["timed_steps"] == per_epoch + 1 and ck["seconds"] > 0      # recipe --status's time left
    first = ck["seconds"]
    train(replace(cfg, out_dir=str(tmp_path / "b")), **kw)             # resumes in the second epoch
    ck = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert ck["timed_steps"] == 2 * per_epoch and ck["seconds"] > first  # both processes' steps, counted once
    part = train(replace(cfg, out_dir=str(tmp_path / "c"), stop_after_steps=per_epoch), **kw)  # at an epoch's end
    assert part["stopped"] and part["state"] == {"step": per_epoch, "epoch": 1, "history": []}
    train(replace(cfg, out_dir=str(tmp_path / "c")), **kw)
    a = FalconDrafter.from_pretrained(str(tmp_path / "a")).state_dict()
    for other in ("b", "c"):
        b = FalconDrafter.from_pretrained(str(tmp_path / other)).state_dict()
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_trained_drafter_reaches_high_acceptance(tmp_path, target, data):
    res = train(TrainConfig(str(tmp_path / "d"), k=2, epochs=25, batch_size=8, lr=3e-3, eval_every_epoch=False,
                            tree="chain-4"), samples=data, target=target, log=lambda *a: None)
    assert res["final"]["sim_tau"] > 3.0                            # held-out simulated tau (max 5)
    d = FalconDrafter.from_pretrained(str(tmp_path / "d"), target.config)
    r = FalconReferenceEngine(target, d, "chain-4").generate([5, 9, 17, 33], 40)
    assert r.tau > 2.5, r.tau                                       # random drafter: ~1.0


def test_a_frozen_draft_head_is_stored_as_its_map_and_continues_frozen(tmp_path, target, data):
    """--freeze-draft-head: the head stays the target's rows of the most frequent answer tokens and the checkpoint
    holds only their d2t map (Falcon and EAGLE layouts); loaded and attached, the drafter is the one trained;
    --init-from continues it only as a frozen-head run."""
    from safetensors import safe_open

    kw = dict(samples=data, target=target, log=lambda *a: None)
    base = TrainConfig(str(tmp_path / "a"), k=2, epochs=1, batch_size=8, lr=3e-3, draft_vocab=32,
                       eval_every_epoch=False, eval_roots=12, train_draft_head=False)
    train(base, **kw)
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:
        assert "d2t" in f.keys() and "lm_head.weight" not in f.keys()
    a = FalconDrafter.from_pretrained(str(tmp_path / "a"), target.config)
    assert a.config.frozen_head
    a.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    assert torch.equal(a.lm_head.weight, target.lm_head.weight.detach()[a.draft_ids])
    b = train(replace(base, out_dir=str(tmp_path / "b"), lr=0.0, init_from=str(tmp_path / "a")), **kw)
    assert b["final"]["sim_tau"] > 0
    with pytest.raises(ValueError, match="another architecture.*frozen_head"):
        train(replace(base, out_dir=str(tmp_path / "c"), train_draft_head=True, init_from=str(tmp_path / "a")), **kw)
    train(TrainConfig(str(tmp_path / "e"), mode="eagle", epochs=1, batch_size=8, draft_vocab=32,
                      eval_every_epoch=False, eval_roots=12, train_draft_head=False), **kw)
    with safe_open(str(tmp_path / "e" / "vllm-eagle" / "model.safetensors"), "pt") as f:
        assert "d2t" in f.keys() and "lm_head.weight" not in f.keys()
    assert json.loads((tmp_path / "e" / "vllm-eagle" / "config.json").read_text())["frozen_head"] is True


def test_init_from_continues_a_trained_drafter(tmp_path, target, data):
    """--init-from loads a trained drafter whole (truncated head and d2t map included, not re-derived from
    the data), records what it continued, and refuses another architecture; given more layers than its
    source, it grows it (the new layer starts as the identity) but never shrinks one."""
    kw = dict(samples=data, target=target, log=lambda *a: None)
    base = TrainConfig(str(tmp_path / "a"), k=2, epochs=1, batch_size=8, lr=3e-3, draft_vocab=32,
                       eval_every_epoch=False, eval_roots=12)
    train(base, **kw)
    a = FalconDrafter.from_pretrained(str(tmp_path / "a"), target.config)
    with torch.no_grad():  # a map the data would not give: an init that re-derived it would differ
        a.d2t.copy_(torch.arange(32, 64) - torch.arange(32))
    a.save_pretrained(str(tmp_path / "a"))
    # lr 0: the continuation changes nothing, so what it saves is exactly what it loaded
    b_final = train(replace(base, out_dir=str(tmp_path / "b"), lr=0.0, init_from=str(tmp_path / "a")), **kw)["final"]
    b = FalconDrafter.from_pretrained(str(tmp_path / "b"), target.config)
    assert all(torch.equal(v, b.state_dict()[n]) for n, v in a.state_dict().items())
    rec = b.config.extra["training"]
    assert rec["init_from"]["drafter"] == "a" and rec["init_from"]["training"]["lr"] == 3e-3
    assert "init_from" in rec and str(tmp_path) not in json.dumps(rec)   # no machine path in the record
    # EAGLE mode continues the vLLM-layout export it shipped
    train(TrainConfig(str(tmp_path / "e"), mode="eagle", epochs=1, batch_size=8, draft_vocab=32,
                      eval_every_epoch=False, eval_roots=12), **kw)
    train(TrainConfig(str(tmp_path / "f"), mode="eagle", epochs=1, batch_size=8, draft_vocab=32, lr=0.0,
                      eval_every_epoch=False, eval_roots=12, init_from=str(tmp_path / "e" / "vllm-eagle")), **kw)
    e, f = (FalconDrafter.from_pretrained(str(tmp_path / d), target.config) for d in "ef")
    assert all(torch.equal(v, f.state_dict()[n]) for n, v in e.state_dict().items())
    # an EAGLE-1 drafter (k=1) seeds a Falcon drafter of k=2 in either block order: no weight depends on k
    train(TrainConfig(str(tmp_path / "s"), k=2, fusion="fc", block_order="reversed", epochs=1, batch_size=8,
                      lr=0.0, draft_vocab=32, eval_every_epoch=False, eval_roots=12,
                      init_from=str(tmp_path / "e" / "vllm-eagle")), **kw)
    sd = FalconDrafter.from_pretrained(str(tmp_path / "s"), target.config)
    assert sd.config.k == 2 and sd.config.extra["training"]["init_from"]["k_from"] == 1
    assert all(torch.equal(v, sd.state_dict()[n]) for n, v in e.state_dict().items())
    for bad, what in ((dict(draft_vocab=16), "draft_vocab_size"), (dict(block_order="reversed"), "block_order"),
                      (dict(k=1), "k 2 \\(run: 1\\)")):  # only a k=1 source seeds another k
        with pytest.raises(ValueError, match=f"another architecture.*{what}"):
            train(replace(base, out_dir=str(tmp_path / "c"), init_from=str(tmp_path / "a"), **bad), **kw)
    # more layers: grown, the new one the identity, so with lr 0 it scores exactly what its source scored
    g = train(replace(base, out_dir=str(tmp_path / "g"), lr=0.0, layers=2, init_from=str(tmp_path / "a")), **kw)
    assert {n: g["final"][n] for n in ("top1_by_block_position", "sim_tau")} == \
        {n: b_final[n] for n in ("top1_by_block_position", "sim_tau")}
    gd = FalconDrafter.from_pretrained(str(tmp_path / "g"), target.config)
    assert gd.config.num_layers == 2 and gd.config.extra["training"]["init_from"]["grown_layers"] == [1]
    assert all(torch.equal(v, gd.state_dict()[n]) for n, v in a.state_dict().items())
    assert not gd.layers[1].self_attn.o_proj.weight.any() and not gd.layers[1].mlp.down_proj.weight.any()
    assert gd.layers[1].self_attn.q_proj.weight.any()                  # the rest of the layer is initialised
    with pytest.raises(ValueError, match="another architecture.*num_layers 2 \\(run: 1\\)"):  # never shrunk
        train(replace(base, out_dir=str(tmp_path / "c"), init_from=str(tmp_path / "g")), **kw)
    # a level embedding starts at zero: a drafter without one seeds it and scores what it scored; never dropped
    lv = train(replace(base, out_dir=str(tmp_path / "l"), lr=0.0, level_embedding=True, init_from=str(tmp_path / "a")),
               **kw)
    assert {n: lv["final"][n] for n in ("top1_by_block_position", "sim_tau")} == \
        {n: b_final[n] for n in ("top1_by_block_position", "sim_tau")}
    ld = FalconDrafter.from_pretrained(str(tmp_path / "l"), target.config)
    assert ld.config.level_embedding and not ld.level_emb.any()
    with pytest.raises(ValueError, match="another architecture.*level_embedding True \\(run: False\\)"):
        train(replace(base, out_dir=str(tmp_path / "c"), init_from=str(tmp_path / "l")), **kw)


def test_eagle_mode_exports_vllm_layout(tmp_path, target, data):
    """... with an MLP narrower than the target's (--intermediate-size), kept by both layouts."""
    train(TrainConfig(str(tmp_path / "e"), mode="eagle", epochs=1, batch_size=8, eval_every_epoch=False,
                      intermediate_size=48), samples=data, target=target, log=lambda *a: None)
    cfg = json.loads((tmp_path / "e" / "vllm-eagle" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "falcon" not in cfg
    assert cfg["intermediate_size"] == 48 != target.config.intermediate_size
    from safetensors.torch import load_file
    keys = set(load_file(str(tmp_path / "e" / "vllm-eagle" / "model.safetensors")))
    assert "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys
    assert not any(k.startswith("layers.0.input_layernorm") for k in keys)
    # the export loads back (reference engine) as the k=1 fc drafter it came from, same weights
    src = FalconDrafter.from_pretrained(str(tmp_path / "e"), target.config)
    back = FalconDrafter.from_vllm_eagle(str(tmp_path / "e" / "vllm-eagle"), target.config)
    assert (back.config.k, back.config.fusion, back.config.intermediate_size) == (1, "fc", 48)
    assert all(torch.equal(v, back.state_dict()[n]) for n, v in src.state_dict().items())
    with pytest.raises(ValueError, match="Falcon-format"):
        FalconDrafter.from_vllm_eagle(str(tmp_path / "e"), target.config)
    with pytest.raises(ValueError, match="another target"):
        FalconDrafter.from_vllm_eagle(str(tmp_path / "e" / "vllm-eagle"), tiny_llama(vocab=96, seed=1).config)


def test_cached_teacher_matches_full_teacher(target, data):
    """With top-k = vocab the cached teacher gives exactly the losses of the full teacher."""
    from falcon_vllm.config import FalconConfig
    from falcon_vllm.train.data import teacher_cache, crop_context
    from falcon_vllm.train.losses import subsample

    torch.manual_seed(0)
    d = FalconDrafter(FalconConfig.from_target(target.config, k=2)).attach_target(
        target.get_input_embeddings(), target.get_output_embeddings())
    cache = teacher_cache(data[:4], target.get_output_embeddings(), topk=64)
    plain = make_batch(data[:4], 2, 64)
    cached = make_batch([s._replace(teacher=c) for s, c in zip(data[:4], cache)], 2, 64)
    assert torch.equal(plain["loss"], cached["loss"])
    pred = forward(d, plain["ids_in"], plain["feat_in"], plain)
    l0, p0 = losses(d, pred, plain, plain["loss"], 0.1, 0.9)
    l1, p1 = losses(d, pred, cached, cached["loss"], 0.1, 0.9)
    assert abs(p0["soft"] - p1["soft"]) < 1e-4 and abs(p0["ce"] - p1["ce"]) < 1e-4 and abs(float((l0 - l1).detach())) < 1e-4
    # chunks of rows across conversations (a chunk boundary inside a conversation) give the same cache
    small = teacher_cache(data[:4], target.get_output_embeddings(), topk=64, chunk=7)
    assert all(torch.allclose(a[n].float(), b[n].float(), atol=1e-5) for a, b in zip(cache, small) for n in a)
    assert all(torch.equal(a["arg"], b["arg"]) for a, b in zip(cache, small))
    assert int((cache[0]["arg"] >= 0).sum()) == int(data[0].loss_mask[1:].sum())   # every answer-predicting row
    # a random subset of the loss positions for the LM head: a subset, of the requested size
    sub = subsample(plain["loss"], 50, torch.Generator().manual_seed(0))
    assert int(sub.sum()) == 50 and not (sub & ~plain["loss"]).any()
    # cropped prompt context keeps every answer token and its feature
    s, c = data[0], crop_context(data[0], 2)
    assert int(c.loss_mask.sum()) == int(s.loss_mask.sum()) and int((~c.loss_mask).sum()) == 2
    assert torch.equal(c.features[-1], s.features[-1]) and c.teacher is None


def test_teacher_cache_in_bf16_keeps_fp32s_top_k(target, data):
    """The bf16 product over the vocabulary with its top candidates recomputed in fp32: the same argmax, top-k ids
    and logits as the fp32 cache, log-sum-exps close; on logits large enough that bf16 alone ranks rows wrongly."""
    from falcon_vllm.train.data import teacher_cache

    torch.manual_seed(0)
    head = torch.nn.Linear(target.config.hidden_size, 64, bias=True)
    with torch.no_grad():
        head.weight.mul_(40.0)
        head.bias.normal_()
    full = teacher_cache(data[:6], head, topk=8)
    fast = teacher_cache(data[:6], head, topk=8, bf16=True, margin=8, chunk=50)
    rows = torch.cat([c["arg"] >= 0 for c in full])
    assert int(rows.sum()) > 250
    f = {n: torch.cat([c[n] for c in full])[rows] for n in full[0]}
    b = {n: torch.cat([c[n] for c in fast])[rows] for n in fast[0]}
    assert torch.equal(f["arg"], b["arg"]) and torch.equal(f["idx"], b["idx"])
    assert torch.allclose(f["val"], b["val"], atol=1e-4)
    assert torch.allclose(f["lse"], b["lse"], atol=2e-3) and torch.allclose(f["lseT"], b["lseT"], atol=2e-3)
    # bf16 alone would not do: its own argmax differs from fp32's on some rows
    with torch.no_grad():
        feats = torch.cat([s.hidden[c["arg"] >= 0] for s, c in zip(data[:6], full)])
        alone = (feats.bfloat16() @ head.weight.bfloat16().t() + head.bias.bfloat16()).float().argmax(-1)
    assert (alone != f["arg"]).any()


def test_teacher_cache_is_built_once_by_runs_side_by_side(tmp_path, target, data, monkeypatch):
    """Two runs starting on the same data directory at once: one builds the teacher cache, the other waits on
    its lock and loads what it wrote (both get the same cache); a later run only loads it."""
    import threading

    import falcon_vllm.train.data as trainer

    built, started = [], threading.Event()
    real = trainer.teacher_cache

    def slow(*a, **kw):
        built.append(1)
        started.set()
        time.sleep(0.5)  # the other run asks for the cache while this one builds it
        return real(*a, **kw)

    monkeypatch.setattr(trainer, "teacher_cache", slow)
    out, logs = {}, []

    def run(name):
        out[name] = trainer.cached_teacher(str(tmp_path), data[:4], target.get_output_embeddings(), 8, logs.append)

    first = threading.Thread(target=run, args=("a",))
    first.start()
    started.wait(10)
    second = threading.Thread(target=run, args=("b",))
    second.start()
    first.join()
    second.join()
    assert len(built) == 1 and any("waiting for another run" in m for m in logs)
    assert all(torch.equal(x[n], y[n]) for x, y in zip(out["a"], out["b"]) for n in x)
    run("c")
    assert len(built) == 1 and all(torch.equal(x["idx"], y["idx"]) for x, y in zip(out["a"], out["c"]))


def test_teacher_cache_of_grown_data_reuses_its_first_conversations(tmp_path, target, data, monkeypatch):
    """gen-data appends shards: the cache of a data set's first conversations is reused and only the new ones
    go through the head; the result is the whole set's cache. A stored cache that does not fit is not used."""
    import falcon_vllm.train.data as trainer

    assert len(data) >= 5
    head, real, computed, logs = target.get_output_embeddings(), trainer.teacher_cache, [], []

    def counting(samples, *a, **kw):
        computed.append(len(samples))
        return real(samples, *a, **kw)

    monkeypatch.setattr(trainer, "teacher_cache", counting)
    trainer.cached_teacher(str(tmp_path), data[:3], head, 8, logs.append)
    grown = trainer.cached_teacher(str(tmp_path), data[:5], head, 8, logs.append)
    assert computed == [3, 2] and any("first 3 conversations" in m for m in logs)
    whole = real(data[:5], head, 8)
    assert all(torch.equal(x[n], y[n]) for x, y in zip(grown, whole) for n in x)
    # a stored cache whose rows do not fit the data's first conversations is not used; one that fits is
    other = str(tmp_path / "other")
    os.makedirs(other)
    torch.save(real(data[1:4], head, 8), os.path.join(other, "teacher_top8_n3_x.pt"))
    assert [len(s.tokens) for s in data[:3]] != [len(s.tokens) for s in data[1:4]]
    assert trainer.prefix_cache(other, "teacher_top8_n", "_x.pt", data[:5]) == []
    assert len(trainer.prefix_cache(other, "teacher_top8_n", "_x.pt", data[1:6])) == 3
    assert len(trainer.prefix_cache(other, "teacher_top8_n", "_x.pt", data[1:4])) == 3  # as many as stored
    assert trainer.prefix_cache(other, "teacher_top8_n", "_x.pt", data[1:3]) == []  # fewer than stored
    # another data set's cache (another tag: a recipe's extra sets grown by one more set) is reused where it fits;
    # one of the same lengths whose answer rows differ is not
    os.rename(os.path.join(other, "teacher_top8_n3_x.pt"), os.path.join(other, "teacher_top8_n3_0123abcd.pt"))
    assert len(trainer.prefix_cache(other, "teacher_top8_n", "_89abcdef.pt", data[1:6])) == 3
    moved = data[2].loss_mask.clone()
    first = int(moved.nonzero()[0])
    moved[first], moved[first - 1] = 0, 1  # the answer begins one token earlier, the length unchanged
    assert trainer.prefix_cache(other, "teacher_top8_n", "_89abcdef.pt",
                                [data[1], data[2]._replace(loss_mask=moved)] + list(data[3:6])) == []


def test_an_interrupted_teacher_cache_build_resumes_where_it_stopped(tmp_path, target, data, monkeypatch):
    """The build writes the cache so far every save_minutes (here after every block of 2 conversations, each partial
    cache replacing the one before); killed in its third block, the next build computes only the last
    conversation, its cache is the one built in one go, and the partial cache is gone."""
    import falcon_vllm.train.data as trainer

    head, real, computed = target.get_output_embeddings(), trainer.teacher_cache, []

    def dies_in_third_block(samples, *a, **kw):
        if len(computed) == 2:
            raise KeyboardInterrupt
        computed.append(len(samples))
        return real(samples, *a, **kw)

    monkeypatch.setattr(trainer, "teacher_cache", dies_in_third_block)
    with pytest.raises(KeyboardInterrupt):
        trainer.cached_teacher(str(tmp_path), data[:5], head, 8, block=2, save_minutes=0)
    def stored():
        return sorted(n.split("_", 2)[2][:-len("_12345678.pt")] for n in os.listdir(tmp_path) if n.endswith(".pt"))

    assert stored() == ["n4_partial"]                                    # n2_partial was replaced by n4_partial
    monkeypatch.setattr(trainer, "teacher_cache", lambda samples, *a, **kw: (computed.append(len(samples)),
                                                                             real(samples, *a, **kw))[1])
    logs = []
    cache = trainer.cached_teacher(str(tmp_path), data[:5], head, 8, logs.append, block=2, save_minutes=0)
    assert computed == [2, 2, 1] and any("first 4 conversations" in m for m in logs)
    assert stored() == ["n5"]                                            # the whole cache replaces the partial
    whole = real(data[:5], head, 8)
    assert all(torch.equal(x[n], y[n]) for x, y in zip(cache, whole) for n in x)


def test_glancing_with_observed_subset(data):
    k = 2
    b = make_batch(data[:4], k, 64)
    teacher = b["lbl_ids"]
    pred = torch.where(torch.rand(teacher.shape, generator=torch.Generator().manual_seed(1)) < 0.5, teacher, -1)
    obs = b["loss"].clone()
    obs[:, ::2] = False  # drafter tokens known on half of the loss positions
    pos = glance_positions(pred, teacher, b["loss"], k, 1.0, "error", random.Random(0), observed=obs)
    for i, p in enumerate(pos):
        o = obs[i].nonzero().flatten()
        wrong = int((pred[i, o] != teacher[i, o]).sum())
        assert len(p) == min(round(wrong * int(b["loss"][i].sum()) / len(o)), wrong)  # d scaled to all positions
        assert obs[i, p].all() and (pred[i, p] != teacher[i, p]).all()


class _FakeChatTokenizer:
    """A chat template over a tiny vocabulary: <s>=1 user=2 asst=3 eot=4 text chars -> 5 + ord % 50."""

    def apply_chat_template(self, msgs, add_generation_prompt=False):
        out = [1]
        for m in msgs:
            out += [2 if m["role"] == "user" else 3] + [5 + ord(c) % 50 for c in m["content"]] + [4, 60]
        return out + ([3] if add_generation_prompt else [])


class _FakeTokenizer(_FakeChatTokenizer):
    pad_token_id, eos_token_id = 0, 4


def test_gen_data_answers_file_reproduces_the_data(tmp_path, target, monkeypatch):
    """--save-answers keeps the generated tokens; a run given them featurizes them without generating, into
    the same shards; a file made with other settings or for other prompts is refused."""
    from falcon_vllm.train import gen_data

    convs = [{"conversations": [{"from": "human", "value": f"q{i}" * (1 + i % 3)}, {"from": "gpt", "value": "a"}]}
             for i in range(10)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    kw = dict(model=target, tokenizer=_FakeTokenizer(), data=str(tmp_path / "sg.json"), backend="hf", shard_size=4)
    gen_data.run("tiny", str(tmp_path / "a"), 6, 8, **kw)
    assert gen_data.save_answers(str(tmp_path / "a"), str(tmp_path / "ans.safetensors")) == 6

    def no_generate(*a, **k):
        raise AssertionError("stored conversations must not be generated again")
    monkeypatch.setattr(gen_data, "greedy_batch", no_generate)
    with pytest.raises(AssertionError, match="must not be generated"):  # conversations 6-9 are not stored
        gen_data.run("tiny", str(tmp_path / "b"), 10, 8, answers=str(tmp_path / "ans.safetensors"), **kw)
    b = gen_data.run("tiny", str(tmp_path / "c"), 4, 8, answers=str(tmp_path / "ans.safetensors"), **kw)
    shards = json.loads((b / "manifest.json").read_text())["shards"]
    assert [sh["from_answers"] for sh in shards] == [True]
    a_s, b_s = load_shards(str(tmp_path / "a"))[:4], load_shards(str(b))
    assert len(b_s) == 4 and all(torch.equal(x.tokens, y.tokens) and torch.equal(x.loss_mask, y.loss_mask)
                                 and torch.equal(x.features, y.features) for x, y in zip(a_s, b_s))
    with pytest.raises(ValueError, match="other settings: max_new_tokens '8' \\(this run: '9'\\)"):
        gen_data.run("tiny", str(tmp_path / "d"), 4, 9, answers=str(tmp_path / "ans.safetensors"), **kw)
    (tmp_path / "sg2.json").write_text(json.dumps(convs[1:]))  # other prompts, same settings
    with pytest.raises(ValueError, match="conversation 0 does not begin with this data's prompt"):
        gen_data.run("tiny", str(tmp_path / "e"), 4, 8, answers=str(tmp_path / "ans.safetensors"),
                     **{**kw, "data": str(tmp_path / "sg2.json")})
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="could not be read"):
        gen_data.run("tiny", str(tmp_path / "f"), 4, 8, answers=str(tmp_path / "bad.safetensors"), **kw)


def test_gen_data_answers_only_grows_a_file_that_featurizes_as_a_full_run(tmp_path, target, monkeypatch):
    """--answers-only answers through one engine kept up across shards, writes the answers file after every
    shard, resumes from it, records each run; featurizing that file later gives a full run's shards."""
    import falcon_vllm.vllm.generate as vgen
    from falcon_vllm.train import gen_data, grow
    from falcon_vllm.train.answer_files import answers_meta

    engines = []

    class Engine:  # stands in for vLLM's engine: the tiny target's greedy answers
        def __init__(self, target_dir, max_model_len, max_num_seqs=128, dtype="float32"):
            engines.append(dtype)
            self.answer = gen_data.hf_generator(target, 0, {4})

        def __call__(self, prompts, max_new_tokens):
            return self.answer(prompts, max_new_tokens)

        def close(self):
            engines.append("closed")

    monkeypatch.setattr(vgen, "VLLMGenerator", Engine)
    convs = [{"conversations": [{"from": "human", "value": f"q{i}" * (1 + i % 3)}, {"from": "gpt", "value": "a"}]}
             for i in range(10)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    f, kw = str(tmp_path / "ans.safetensors"), dict(data=str(tmp_path / "sg.json"), tokenizer=_FakeTokenizer())
    assert grow.answers_only("tiny", f, 6, 8, 4, gen_dtype="bfloat16", **kw) == 6  # shards of 4 and 2
    assert engines == ["bfloat16", "closed"]  # one engine for both shards
    assert grow.answers_only("tiny", f, 10, 8, 4, **kw) == 10  # resumed: conversations 6-9 only
    runs = json.loads(answers_meta(f)["runs"])
    assert [(r["conversations"], r["dtype"]) for r in runs] == [(6, "bfloat16"), (4, "float32")]
    assert all(r["answer_tokens"] > 0 for r in runs)
    hf = dict(model=target, backend="hf", shard_size=4, **kw)
    full = load_shards(str(gen_data.run("tiny", str(tmp_path / "full"), 10, 8, **hf)))
    later = load_shards(str(gen_data.run("tiny", str(tmp_path / "later"), 10, 8, answers=f, **hf)))
    assert len(later) == 10 and all(torch.equal(x.tokens, y.tokens) and torch.equal(x.features, y.features)
                                    for x, y in zip(full, later))
    with pytest.raises(ValueError, match="other settings: max_new_tokens"):
        grow.answers_only("tiny", f, 10, 9, 4, **kw)
    # the file names the prompts it answered, and featurizing it against other prompts says which they were
    assert answers_meta(f)["data"] == "sg.json"
    (tmp_path / "other.json").write_text(json.dumps(convs[1:]))
    with pytest.raises(ValueError, match=r"does not begin with this data's prompt \(another dataset, template or "
                                         r"order; its answers were made from --data sg.json\)"):
        gen_data.run("tiny", str(tmp_path / "wrong"), 4, 8, answers=f, **{**hf, "data": str(tmp_path / "other.json")})


def test_answers_only_continues_the_first_turns_of_another_file(tmp_path, target, monkeypatch):
    """--answers-only OUT --answers FIRST --max-turns 2 --loss-from-turn 2 answers only the second questions of
    FIRST's conversations, resumes by shard, and OUT featurizes as gen-data's own continuation of FIRST does."""
    import falcon_vllm.vllm.generate as vgen
    from falcon_vllm.train import gen_data, grow
    from falcon_vllm.train.answer_files import answers_meta

    asked = []

    class Engine:  # stands in for vLLM's engine: the tiny target's greedy answers
        def __init__(self, *a, **k):
            self.answer = gen_data.hf_generator(target, 0, {4})

        def __call__(self, prompts, max_new_tokens):
            asked.extend(prompts)
            return self.answer(prompts, max_new_tokens)

        def close(self):
            pass

    monkeypatch.setattr(vgen, "VLLMGenerator", Engine)
    convs = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]
              + ([{"from": "human", "value": f"z{i}" * 2}, {"from": "gpt", "value": "b"}] if i % 3 else [])}
             for i in range(8)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    kw = dict(data=str(tmp_path / "sg.json"), tokenizer=_FakeTokenizer())
    first, out = str(tmp_path / "first.safetensors"), str(tmp_path / "second.safetensors")
    grow.answers_only("tiny", first, 8, 8, 4, **kw)
    asked.clear()
    turn2 = dict(continues=first, max_turns=2, loss_from_turn=2, **kw)
    assert grow.answers_only("tiny", out, 4, 8, 4, **turn2) == 4
    assert grow.answers_only("tiny", out, 8, 8, 4, **turn2) == 8    # resumed: conversations 4-7 only
    stored = [q for q, _ in gen_data.load_answers(first, answers_meta(first))[0]]
    assert len(asked) == 5 and all(any(p[:len(q)] == q for q in stored) for p in asked)  # second questions only
    # featurized, it is token for token gen-data's own continuation of the first turns
    hf = dict(model=target, backend="hf", shard_size=4, max_turns=2, loss_from_turn=2, **kw)
    mine = load_shards(str(gen_data.run("tiny", str(tmp_path / "a"), 8, 8, answers=out, **hf)))
    theirs = load_shards(str(gen_data.run("tiny", str(tmp_path / "b"), 8, 8, answers=first, **hf)))
    assert all(torch.equal(x.tokens, y.tokens) and torch.equal(x.loss_mask, y.loss_mask) for x, y in zip(mine, theirs))
    assert [bool(x.loss_mask.any()) for x in mine] == [bool(i % 3) for i in range(8)]
    grow.answers_only("tiny", str(tmp_path / "short.safetensors"), 2, 8, 4, **kw)
    with pytest.raises(ValueError, match="holds 2 conversations, fewer than the 4 to continue"):
        grow.answers_only("tiny", str(tmp_path / "x.safetensors"), 4, 8, 4,
                          **{**turn2, "continues": str(tmp_path / "short.safetensors")})
    with pytest.raises(ValueError, match="holds 2-turn conversations: nothing to continue"):
        grow.answers_only("tiny", str(tmp_path / "y.safetensors"), 4, 8, 4, **{**turn2, "continues": out})


def test_gen_data_resumes_by_shard(tmp_path, target, monkeypatch):
    """A run into a directory that holds shards generates only the missing ones, keeps the written shards as
    they are, and starts its progress bar at them (so the bar's rate and ETA are the new work's)."""
    import tqdm as tqdm_mod

    from falcon_vllm.train import gen_data

    convs = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
             for i in range(6)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    kw = dict(model=target, tokenizer=_FakeTokenizer(), data=str(tmp_path / "sg.json"), backend="hf", shard_size=2)
    out = gen_data.run("tiny", str(tmp_path / "d"), 4, 8, **kw)
    first = (out / "shard_00000.safetensors").read_bytes()
    generated, bars = [], []
    real_greedy, real_tqdm = gen_data.greedy_batch, tqdm_mod.tqdm
    monkeypatch.setattr(gen_data, "greedy_batch", lambda m, prompts, *a: generated.append(len(prompts)) or
                        real_greedy(m, prompts, *a))

    class Bar(real_tqdm):
        def __init__(self, *a, **k):
            bars.append(k)
            super().__init__(*a, **k)
    monkeypatch.setattr(tqdm_mod, "tqdm", Bar)
    gen_data.run("tiny", str(out), 6, 8, **kw)
    assert generated == [2]  # conversations 4-5 only
    assert bars[0]["total"] == 6 and bars[0]["initial"] == 4
    assert (out / "shard_00000.safetensors").read_bytes() == first
    manifest = json.loads((out / "manifest.json").read_text())
    assert [sh["file"] for sh in manifest["shards"]] == [f"shard_0000{i}.safetensors" for i in range(3)]
    assert len(load_shards(str(out))) == 6
    # a run of more conversations writes the last shard again where it holds fewer than a shard's
    gen_data.run("tiny", str(tmp_path / "d4"), 3, 8, **{**kw, "shard_size": 4})
    generated.clear()
    gen_data.run("tiny", str(tmp_path / "d4"), 6, 8, **{**kw, "shard_size": 4})
    assert generated == [4, 2]  # the first shard whole again (3 conversations of 4 before), then the next one
    assert [sh["conversations"] for sh in json.loads((tmp_path / "d4" / "manifest.json").read_text())["shards"]] == [4, 2]
    assert [s.tokens.tolist() for s in load_shards(str(tmp_path / "d4"))] == [s.tokens.tolist() for s in load_shards(str(out))][:6]


def test_gen_data_featurizes_the_data_replies(tmp_path, target, monkeypatch):
    """--replies data: each prompt followed by its conversation's own first reply (cut after the end of turn or
    at max_new_tokens), the target's features over it, nothing generated; other turn settings or a resume
    with target replies are refused."""
    from falcon_vllm.train import gen_data

    replies = ["ab", "a much longer reply", ""]
    convs = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": r}]}
             for i, r in enumerate(replies)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    monkeypatch.setattr(gen_data, "greedy_batch", lambda *a, **k: pytest.fail("--replies data must not generate"))
    tok = _FakeTokenizer()
    kw = dict(model=target, tokenizer=tok, data=str(tmp_path / "sg.json"), backend="hf", shard_size=2)
    out = gen_data.run("tiny", str(tmp_path / "d"), 3, 8, replies="data", **kw)
    got = load_shards(str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["generation"] == "the data's own replies" and manifest["backend"] is None
    for i, (s, r) in enumerate(zip(got, replies)):
        prompt = tok.apply_chat_template([{"role": "user", "content": f"q{i}"}], add_generation_prompt=True)
        ans = ([5 + ord(c) % 50 for c in r] + [4])[:8] if r else []
        assert s.tokens.tolist() == prompt + ans and s.loss_mask.tolist() == [0] * len(prompt) + [1] * len(ans)
        with torch.no_grad():
            h = target.base_model(input_ids=s.tokens[None].long()).last_hidden_state[0]
        assert torch.allclose(s.features.float(), h.to(torch.bfloat16).float(), atol=1e-2)
    assert len(got[0].tokens) - int(got[0].loss_mask.nonzero()[0]) == 3  # "ab" + end of turn
    assert int(got[1].loss_mask.sum()) == 8 and int(got[2].loss_mask.sum()) == 0  # capped; no reply
    with pytest.raises(ValueError, match="first replies only"):
        gen_data.run("tiny", str(tmp_path / "e"), 3, 8, replies="data", max_turns=2, **kw)
    with pytest.raises(ValueError, match="other --replies \\(generation \"the data's own replies\", now 'greedy .*resume with the same"):
        gen_data.run("tiny", str(tmp_path / "d"), 3, 8, **kw)
    gen_data.save_answers(str(out), str(tmp_path / "replies.safetensors"))  # never passed off as the target's
    with pytest.raises(ValueError, match="other settings: generation \"the data's own replies\""):
        gen_data.run("tiny", str(tmp_path / "f"), 3, 8, answers=str(tmp_path / "replies.safetensors"), **kw)


def test_gen_data_resume_refuses_other_settings_and_loses_no_shard(tmp_path, target):
    """A directory resumed with other settings is refused, naming the flag; a run of fewer conversations keeps the
    shards past it listed apart (a run of more then writes none of them again); a truncated shard is named when
    read and written again by the same gen-data command."""
    from falcon_vllm.train import gen_data

    convs = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "ab" * i}]}
             for i in range(6)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    kw = dict(model=target, tokenizer=_FakeTokenizer(), data=str(tmp_path / "sg.json"), backend="hf",
              replies="data")
    d = tmp_path / "d"
    gen_data.run("tiny", str(d), 6, 8, shard_size=2, **kw)
    full = [s.tokens.tolist() for s in load_shards(str(d))]
    for change, flag in [(dict(skip_conversations=1), "--skip-conversations"), (dict(max_new_tokens=4), "--max-new"),
                         (dict(shard_size=3), "--shard-size"), (dict(target_dir="other"), "--target")]:
        args = {"target_dir": "tiny", "max_new_tokens": 8, "shard_size": 2, **change}
        with pytest.raises(ValueError, match=f"written with other {flag}"):
            gen_data.run(args.pop("target_dir"), str(d), 6, args.pop("max_new_tokens"), **args, **kw)
    stamp = lambda: {p.name: p.stat().st_mtime_ns for p in d.glob("shard_*")}  # noqa: E731
    before = stamp()
    gen_data.run("tiny", str(d), 2, 8, shard_size=2, **kw)                  # a run of fewer
    assert [s.tokens.tolist() for s in load_shards(str(d))] == full[:2]
    assert [sh["file"] for sh in json.loads((d / "manifest.json").read_text())["beyond"]] == [
        "shard_00001.safetensors", "shard_00002.safetensors"]
    gen_data.run("tiny", str(d), 6, 8, shard_size=2, **kw)                  # and of more: nothing written again
    assert stamp() == before and "beyond" not in json.loads((d / "manifest.json").read_text())
    path = d / "shard_00001.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="shard_00001.safetensors cannot be read .*write it anew"):
        load_shards(str(d))
    gen_data.run("tiny", str(d), 6, 8, shard_size=2, **kw)
    assert [s.tokens.tolist() for s in load_shards(str(d))] == full
    assert stamp()["shard_00001.safetensors"] != before["shard_00001.safetensors"]


def test_gen_data_two_turns(target):
    from falcon_vllm.train.gen_data import multi_turn

    tok = _FakeChatTokenizer()
    convs = [[{"from": "human", "value": "ab"}, {"from": "gpt", "value": "x"}, {"from": "human", "value": "cd"}],
             [{"from": "human", "value": "ef"}, {"from": "gpt", "value": "y"}]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": c[0]["value"]}], True) for c in convs]
    out = multi_turn(target, tok, convs, prompts, 6, 0, {4}, max_turns=2, max_total_tokens=200)
    t0, m0 = out[0].tokens.tolist(), out[0].loss_mask.tolist()
    # turn 1 answer, closed by eot, then separator + next user turn + generation prompt, then turn 2 answer
    p = len(prompts[0])
    first = t0[p:p + 6]
    assert m0[:p] == [0] * p and m0[p:p + 6] == [1] * 6
    suffix = [4, 60, 2, 5 + ord("c") % 50, 5 + ord("d") % 50, 4, 60, 3] if 4 not in first else None
    if suffix:
        assert t0[p + 6:p + 6 + len(suffix)] == suffix and m0[p + 6:p + 6 + len(suffix)] == [0] * len(suffix)
        assert m0[p + 6 + len(suffix):] == [1] * 6 and len(t0) == p + 6 + len(suffix) + 6
    assert len(out[1].tokens) == len(prompts[1]) + 6  # a single-turn conversation stays single-turn


def test_gen_data_continues_stored_first_turns(tmp_path, target, monkeypatch):
    """--answers of first turns with --max-turns 2: only the second turns are generated, the result is token for
    token the two-turn run's, and --loss-from-turn 2 leaves the first turns as context (loss mask 0)."""
    from falcon_vllm.train import gen_data

    convs = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]
              + ([{"from": "human", "value": f"z{i}" * 2}, {"from": "gpt", "value": "b"}] if i % 3 else [])}
             for i in range(6)]
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    kw = dict(model=target, tokenizer=_FakeTokenizer(), data=str(tmp_path / "sg.json"), backend="hf", shard_size=4)
    gen_data.run("tiny", str(tmp_path / "one"), 6, 8, **kw)
    gen_data.save_answers(str(tmp_path / "one"), str(tmp_path / "one.safetensors"))
    both = load_shards(str(gen_data.run("tiny", str(tmp_path / "both"), 6, 8, max_turns=2, **kw)))
    first = load_shards(str(tmp_path / "one"))
    asked = []
    real = gen_data.greedy_batch

    def recording(model, prompts, *a, **k):
        asked.extend(prompts)
        return real(model, prompts, *a, **k)
    monkeypatch.setattr(gen_data, "greedy_batch", recording)
    later = load_shards(str(gen_data.run("tiny", str(tmp_path / "later"), 6, 8, max_turns=2, loss_from_turn=2,
                                         answers=str(tmp_path / "one.safetensors"), **kw)))
    assert len(asked) == 4  # the four conversations with a second question, none of their first turns again
    assert all(len(p) > len(f.tokens) for p, f in zip(asked, [f for i, f in enumerate(first) if i % 3]))
    for i, (b, f, l) in enumerate(zip(both, first, later)):
        n = len(f.tokens)
        assert torch.equal(l.tokens, b.tokens) and torch.equal(l.tokens[:n], f.tokens)
        assert not l.loss_mask[:n].any() and torch.equal(l.loss_mask[n:], b.loss_mask[n:])
        assert l.loss_mask.any() == bool(i % 3)  # a one-question conversation has nothing to train on
    man = json.loads((tmp_path / "later" / "manifest.json").read_text())
    assert man["loss_from_turn"] == 2 and all(sh["from_answers"] and sh["generate_s"] > 0 for sh in man["shards"])
    gen_data.save_answers(str(tmp_path / "both"), str(tmp_path / "both.safetensors"))
    with pytest.raises(ValueError, match="max_turns '2' \\(this run: '1'\\)"):  # more turns than asked: refused
        gen_data.run("tiny", str(tmp_path / "x"), 4, 8, answers=str(tmp_path / "both.safetensors"), **kw)
    with pytest.raises(ValueError, match="--loss-from-turn must be in 1..--max-turns"):
        gen_data.run("tiny", str(tmp_path / "y"), 4, 8, max_turns=2, loss_from_turn=3, **kw)


def test_held_out_split_leaves_out_prompts_trained_on(data):
    """A held-out conversation whose prompt a training conversation repeats is not held out (its greedy answer
    was trained on); the training conversations stay as they are."""
    from falcon_vllm.train.data import split_held_out

    repeated = [data[-1]] + data[1:]  # 40 conversations, the last 2 held out; the last one's prompt also first
    train_set, val_set, left_out = split_held_out(repeated)
    assert (len(train_set), val_set, left_out) == (38, [data[-2]], 1)
    assert split_held_out(data)[1:] == (data[-2:], 0)
    with pytest.raises(ValueError, match="every held-out conversation repeats"):
        split_held_out([data[0], data[0]])


def test_extra_data_trains_only_outside_the_held_out_set(tmp_path, target, data):
    """--extra-data conversations join the training set, never the held-out one; one that begins like a
    held-out conversation, and one without an answer token, are left out."""
    from falcon_vllm.train.data import outside_of

    held = data[-2:]  # 40 conversations: the last 2 are held out
    no_answer = data[3]._replace(loss_mask=torch.zeros_like(data[3].loss_mask))
    extra = [data[1], held[0], data[2], no_answer]
    assert outside_of(extra, held) == [data[1], data[2], no_answer]
    (tmp_path / "x").mkdir()
    write_shard(tmp_path / "x" / "shard_00000.safetensors",
                [Sample(s.tokens.int(), s.loss_mask.to(torch.uint8), s.features) for s in extra])
    (tmp_path / "x" / "manifest.json").write_text(json.dumps({"shards": [{"file": "shard_00000.safetensors"}]}))
    res = train(TrainConfig(str(tmp_path / "d"), k=2, epochs=1, batch_size=8, eval_every_epoch=False, eval_roots=12,
                            extra_data_dir=str(tmp_path / "x")), samples=data, target=target, log=lambda *a: None)
    f = res["final"]
    assert (f["train_conversations"], f["extra_conversations"], f["extra_left_out"]) == (40, 2, 1)
    assert (f["heldout_conversations"], f["heldout_left_out"]) == (2, 0)


DDP_CONVERSATIONS = 18  # 17 for training (the last 1/16, at least 1, is held out)


def _ddp_worker(rank: int, world: int, port: int, out: str, epochs: int):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    target = tiny_llama(vocab=64, seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (4 + i % 3,), generator=g).tolist() for i in range(DDP_CONVERSATIONS)]
    data = [Sample(s.tokens.long(), s.loss_mask.bool(), s.features)
            for s in generate_and_featurize(target, prompts, 20, 0, set())]
    res = train(TrainConfig(f"{out}/run", k=2, fusion="fc", epochs=epochs, batch_size=4, lr=1e-3, draft_vocab=48,
                            eval_roots=12), samples=data, target=target, log=lambda *a: None)
    torch.save({"state": res["drafter"].state_dict(), "final": res["final"]}, f"{out}/rank{rank}_ep{epochs}.pt")
    torch.distributed.destroy_process_group()


def test_ddp_two_processes_gloo(tmp_path, data):
    """torchrun-style data parallelism on CPU (gloo): both ranks end with the same weights, rank 0 writes
    the checkpoint (resumable with the same number of processes) and the drafter."""
    import socket

    import torch.multiprocessing as mp

    def port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    mp.start_processes(_ddp_worker, args=(2, port(), str(tmp_path), 1), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}_ep1.pt", weights_only=False) for r in (0, 1))
    assert r0["final"] is not None and r1["final"] is None             # rank 0 evaluates
    for name, p in r0["state"].items():
        assert torch.equal(p, r1["state"][name]), name                 # gradients were all-reduced
    ck = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    n_train = DDP_CONVERSATIONS - 1
    steps_per_epoch = (n_train // 4 + (n_train % 4 > 0)) // 2          # batches of 4 split over 2 ranks
    assert ck["world"] == 2 and ck["state"]["step"] == steps_per_epoch
    assert (tmp_path / "run" / "model.safetensors").exists()
    # resume for a second epoch with 2 processes; a single process may not resume a 2-process run
    mp.start_processes(_ddp_worker, args=(2, port(), str(tmp_path), 2), nprocs=2, start_method="spawn")
    ck = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ck["state"]["step"] == 2 * steps_per_epoch and len(ck["state"]["history"]) == 2
    target = tiny_llama(vocab=64, seed=3)
    with pytest.raises(ValueError, match="written by 2 processes"):
        train(TrainConfig(str(tmp_path / "run"), k=2, fusion="fc", epochs=3, batch_size=4, draft_vocab=48),
              samples=data, target=target)


def test_recipe_trains_each_drafter_in_its_stages(tmp_path, monkeypatch):
    """The smollm2 recipe: gen-data from the stored answers, then each drafter's later stages continue the one
    before (init_from, their own epochs, lr and training conversations), and what is installed is the last
    stage, with a datastore of the answers it trained on (stubs: no real training)."""
    from falcon_vllm import models
    from falcon_vllm.train import gen_data, recipes as trainer

    seen, calls = [], {}
    monkeypatch.setattr(models, "model_path", lambda *a: tmp_path / "target")
    monkeypatch.setattr(gen_data, "run", lambda *a, **k: calls.update(gen=k))
    monkeypatch.setattr(trainer, "train", lambda cfg, log=None: seen.append(cfg) or {"final": {}, "out": cfg.out_dir})
    installed = []
    monkeypatch.setattr(trainer, "install_drafter",
                        lambda src, dst, **kw: installed.append((src, os.path.basename(dst), kw.get("files"))))
    (tmp_path / "w").mkdir()  # (gen-data, stubbed here, makes it)
    trainer.run_recipe("smollm2", str(tmp_path / "w"), log=lambda *a: None)
    assert calls["gen"]["answers"] and os.path.exists(calls["gen"]["answers"])   # shipped answers, featurized
    w = str(tmp_path / "w")
    got = [(c.mode, os.path.relpath(c.out_dir, w), c.init_from and os.path.relpath(c.init_from, w), c.epochs, c.lr,
            c.max_conversations) for c in seen]
    assert got == [("falcon", "falcon", None, 5, 2e-3, 3360), ("falcon", "falcon-stage2", "falcon", 4, 1e-3, 3360),
                   ("falcon", "falcon-stage3", "falcon-stage2", 2, 1e-3, 5280),
                   ("falcon", "falcon-stage4", "falcon-stage3", 3, 1e-3, None),
                   ("falcon", "falcon-stage5", "falcon-stage4", 2, 3e-4, None),
                   ("eagle", "eagle", None, 5, 2e-3, 3360), ("eagle", "eagle-stage2", "eagle", 4, 1e-3, 3360),
                   ("eagle", "eagle-stage3", "eagle-stage2", 2, 1e-3, 5280),
                   ("eagle", "eagle-stage4", "eagle-stage3", 3, 1e-3, None),
                   ("eagle", "eagle-stage5", "eagle-stage4", 2, 3e-4, None)]
    assert {c.layers for c in seen[:5]} == {2} and {c.block_order for c in seen[:5]} == {"reversed"}
    assert [(os.path.relpath(s, w), d, f) for s, d, f in installed] == [
        ("falcon-stage5", "smollm2-135m-instruct", ("config.json", "model.safetensors", "datastore.npz")),
        ("eagle-stage5/vllm-eagle", "smollm2-135m-instruct-eagle", None)]
    # the Falcon drafter's datastore: the answers of the 7,680 conversations it trained on (8,192 less 1/16)
    from falcon_vllm.datastore import Datastore

    store = Datastore.load(os.path.join(w, "falcon-stage5", "datastore.npz"))
    assert (store.tokens < 0).sum() == 7680 and (store.min_n, store.max_n) == (3, 4)


def test_recipe_variant_flags(tmp_path, monkeypatch):
    """--recipe with --glance / --block-phase runs a variant: every Falcon stage takes them, the EAGLE stages keep
    the recipe's, and --no-install leaves the source tree alone; any other training flag given with --recipe (the
    recipe would ignore it) is refused, as is an override the recipe does not take."""
    import argparse

    from falcon_vllm import models
    from falcon_vllm.train import gen_data, recipes as trainer, train_command

    p = argparse.ArgumentParser()
    train_command.add_arguments(p)
    assert train_command.recipe_overrides(p.parse_args(["--recipe", "smollm2", "--threads", "2"])) == {}
    args = p.parse_args(["--recipe", "smollm2", "--glance", "none", "--block-phase", "random", "--no-install"])
    over = train_command.recipe_overrides(args)
    assert over == {"glance": "none", "block_phase": "random"}
    with pytest.raises(SystemExit, match="given too: --max-conversations$"):
        train_command.recipe_overrides(p.parse_args(["--recipe", "smollm2", "--lr", "1e-3", "--max-conversations", "10"]))
    # through the command line every option given counts, its default value (--lr 1e-3) too
    from falcon_vllm.cli import main as cli_main

    with pytest.raises(SystemExit, match="given too: --lr, --max-conversations$"):
        cli_main(["train", "--recipe", "smollm2", "--glance", "none", "--lr", "1e-3", "--max-conversations", "10"])
    with pytest.raises(SystemExit, match="--no-install applies to --recipe only"):
        cli_main(["train", "--data", "d", "--out", "o", "--no-install"])
    with pytest.raises(SystemExit, match="--no-baseline applies to --recipe only"):
        cli_main(["train", "--data", "d", "--out", "o", "--no-baseline"])
    with pytest.raises(SystemExit, match="--sets applies to --recipe only"):
        cli_main(["train", "--data", "d", "--out", "o", "--sets", "3"])
    assert train_command.recipe_overrides(p.parse_args(["--recipe", "smollm2", "--no-baseline", "--sets", "1"])) == {}

    seen, installed = [], []
    monkeypatch.setattr(models, "model_path", lambda *a: tmp_path / "target")
    monkeypatch.setattr(gen_data, "run", lambda *a, **k: None)
    monkeypatch.setattr(trainer, "train", lambda cfg, log=None: seen.append(cfg) or {"final": {}, "out": cfg.out_dir})
    monkeypatch.setattr(trainer, "install_drafter", lambda *a, **k: installed.append(a))
    (tmp_path / "w").mkdir()
    with pytest.raises(ValueError, match="not \\['lr'\\]"):
        trainer.run_recipe("smollm2", str(tmp_path / "w"), falcon_overrides={"lr": 1.0}, log=lambda *a: None)
    out = trainer.run_recipe("smollm2", str(tmp_path / "w"), install=not args.no_install, falcon_overrides=over,
                             log=lambda *a: None)
    assert [(c.mode, c.glance, c.block_phase) for c in seen] == [("falcon", "none", "random")] * 5 + [
        ("eagle", "uniform", "fixed")] * 5
    assert installed == [] and "installed" not in out and out["falcon_overrides"] == over
    # --no-baseline: the Falcon drafter alone, installed alone
    seen.clear()
    out = trainer.run_recipe("smollm2", str(tmp_path / "nb"), baseline=False, log=lambda *a: None)
    assert [c.mode for c in seen] == ["falcon"] * 5 and out["eagle"] is None and not out["baseline"]
    assert [os.path.basename(a[1]) for a in installed] == ["smollm2-135m-instruct"]
    assert out["installed"] == ["smollm2-135m-instruct"] and out["drafters"] == [seen[-1].out_dir]


def test_qwen_recipe_featurizes_every_stored_answer_and_fits_the_tree(tmp_path, monkeypatch):
    """The Qwen2.5-Coder-1.5B recipe (drafter v3): gen-data featurizes each answers set in the source tree
    through vLLM and generates nothing (the growing set: every conversation its file holds when the run begins, kept
    for its resumption); Falcon and EAGLE-1
    train in the same two stages on the same data and head (the first set held out, the others extra); tune-tree
    fits serving.json once (a resumed run keeps it); nothing is installed (stubs: no real training)."""
    from falcon_vllm import models, tune_tree
    from falcon_vllm.train import gen_data, recipe_status, recipes as trainer
    from falcon_vllm.train.answer_files import answers_meta

    gens, seen, fits, installed, logs, pinned_first, order = [], [], [], [], [], [], []
    w = str(tmp_path / "w")
    monkeypatch.setattr(models, "model_path", lambda *a: tmp_path / f"target-{a[0] if a else 'default'}")

    def gen(*a, **k):
        gens.append((a, k))
        order.append("featurize")
        pinned_first.append(os.path.exists(os.path.join(w, "recipe_sets.json")))

    monkeypatch.setattr(gen_data, "run", gen)
    answered, real_held = [], trainer.held
    monkeypatch.setattr(trainer, "answers_only", lambda *a, **k: answered.append((a, k)) or order.append("answer"))
    # the fourth set's file as the recipe first meets it (not yet grown in the source tree)
    monkeypatch.setattr(trainer, "held", lambda f: 0 if f.endswith("-from5136.safetensors") else real_held(f))
    monkeypatch.setattr(trainer, "train", lambda cfg, log=None: seen.append(cfg) or {"final": {}, "out": cfg.out_dir})

    def fit(args):
        fits.append(args)
        seen.append("tune-tree")
        with open(args.out, "w") as f:
            f.write("{}")

    monkeypatch.setattr(tune_tree, "main", fit)
    monkeypatch.setattr(trainer, "install_drafter", lambda *a, **k: installed.append(a))
    os.makedirs(os.path.join(w, "falcon-stage4"))  # (training, stubbed here, makes it)
    out = trainer.run_recipe("qwen2.5-coder-1.5b", w, log=logs.append)
    # the Falcon drafter is whole, its trees fitted, before the baseline trains
    assert [c if c == "tune-tree" else c.mode for c in seen] == ["falcon"] * 4 + ["tune-tree"] + ["eagle"] * 4
    seen.remove("tune-tree")
    assert pinned_first[0]  # the growing set's count is fixed before the first set starts
    here = os.path.join(os.path.dirname(trainer.__file__), "answers")
    grown = int(answers_meta(os.path.join(here, "qwen15-sharegpt-from1296.safetensors"))["conversations"])
    assert grown >= 2560
    last = os.path.join(here, "qwen15-sharegpt-from5136.safetensors")  # the set the recipe answers
    got = [(os.path.relpath(a[1], w), a[2], a[3], k["answers"] and os.path.basename(k["answers"]),
            k["data"] and os.path.basename(k["data"]), k["skip_conversations"], k["featurizer"], k["backend"],
            k["save_answers_to"], k["max_turns"], k["loss_from_turn"]) for a, k in gens]
    firsts = [("qwen15-sharegpt", 960, 0), ("qwen15-sharegpt-from1296", 3840, 1296),
              ("qwen15-sharegpt-from5136", 4228, 5136)]   # the first turns the second-turn sets continue
    assert got == [("data/qwen15", 960, 256, "qwen15-sharegpt.safetensors", None, 0, "vllm", "vllm", None, 1, 1),
                   ("data/qwen15-code", 918, 256, "qwen15-code.safetensors", "qwen15-code-questions.json", 0, "vllm",
                    "vllm", None, 1, 1),
                   ("data/qwen15-sharegpt-from5136", 4228, 256, os.path.exists(last) and os.path.basename(last) or None,
                    None, 5136, "vllm", "vllm", None, 1, 1),
                   ("data/qwen15-sharegpt-from1296", grown, 256, "qwen15-sharegpt-from1296.safetensors", None, 1296,
                    "vllm", "vllm", None, 1, 1)] + [
        (f"data/{f}-turn2", n, 256, None, None, skip, "vllm", "vllm", None, 2, 2) for f, n, skip in firsts]
    # what the files lack is answered first through vLLM, into the files, the states kept in the sets' directories,
    # before any set is featurized (the answers are what a lost machine keeps); a second-turn set continues the
    # first turns of its first-turn file, answered before it
    assert order == ["answer"] * 4 + ["featurize"] * 7
    assert [(a[1], a[2], a[3], a[4], k) for a, k in answered] == [
        (last, 4228, 256, 64, {"data": None, "skip_conversations": 5136, "max_turns": 1, "loss_from_turn": 1,
                               "continues": None, "out_dir": os.path.join(w, "data", "qwen15-sharegpt-from5136")})] + [
        (os.path.join(here, f"{f}-turn2.safetensors"), n, 256, 64,
         {"data": None, "skip_conversations": skip, "max_turns": 2, "loss_from_turn": 2,
          "continues": os.path.join(here, f"{f}.safetensors"), "out_dir": os.path.join(w, "data", f"{f}-turn2")})
        for f, n, skip in firsts]
    assert all(str(a[0]).endswith("target-qwen2.5-coder-1.5b-instruct") for a, _ in gens + answered)
    data, extra = os.path.join(w, "data", "qwen15"), ",".join(os.path.join(w, "data", n) for n in (
        "qwen15-code", "qwen15-sharegpt-from5136", "qwen15-sharegpt-from1296"))
    v3 = ",".join(extra.split(",")[:2])  # stages 1-2 (drafter v3) on the first three sets, stage 3 on all four
    every = ",".join([extra] + [os.path.join(w, "data", f"{f}-turn2") for f, _, _ in firsts])  # stage 4: all seven
    assert [(c.mode, os.path.relpath(c.out_dir, w), c.init_from and os.path.relpath(c.init_from, w), c.epochs, c.lr,
             c.extra_data_dir) for c in seen] == [
        row for m in ("falcon", "eagle") for row in ((m, m, None, 5, 4e-4, v3), (m, f"{m}-stage2", m, 3, 2e-4, v3),
                                                    (m, f"{m}-stage3", f"{m}-stage2", 3, 2e-4, extra),
                                                    (m, f"{m}-stage4", f"{m}-stage3", 3, 2e-4, every))]
    # bf16 autocast where this machine computes bf16 natively
    assert {c.bf16 for c in seen if c != "tune-tree"} == {trainer.train_bf16("cpu")}
    # the same data, head and MLP width for both drafters; the Falcon stages in v2's architecture
    assert {(c.data_dir, c.draft_vocab, c.train_draft_head, c.intermediate_size, c.layers,
             c.max_conversations) for c in seen} == {(data, 16384, False, 3584, 1, None)}
    assert [c.eval_every_epoch for c in seen] == [False, False, True, True] * 2  # stages 3-4's learning curves
    assert {(c.k, c.fusion, c.block_order) for c in seen[:4]} == {(2, "fc", "reversed")}
    assert len(fits) == 1 and fits[0].drafter == os.path.join(w, "falcon-stage4") and fits[0].data == data
    assert (fits[0].num_prompts, fits[0].batch_sizes, fits[0].widths) == (39, "1,2,4", "2,3,4,6,8,12")
    assert fits[0].out == os.path.join(w, "falcon-stage4", "serving.json")
    assert installed == [] and "installed" not in out and any("installs nothing" in m for m in logs)
    assert json.load(open(os.path.join(w, "recipe_log.json")))["drafters"][0] == os.path.join(w, "falcon-stage4")
    trainer.run_recipe("qwen2.5-coder-1.5b", w, log=logs.append)  # resumed: the fitted trees are kept
    assert len(fits) == 1 and any("serving.json exists: kept" in m for m in logs)
    # resumed after the growing set's file has grown: the same conversations as when the run began
    sets = ["qwen15", "qwen15-code", "qwen15-sharegpt-from5136", "qwen15-sharegpt-from1296"] + [
        f"{f}-turn2" for f, _, _ in firsts]
    assert json.load(open(os.path.join(w, "recipe_sets.json"))) == {"sets": sets,
                                                                    "counts": {"qwen15-sharegpt-from1296": grown}}
    real_meta = answers_meta
    monkeypatch.setattr(trainer, "answers_meta", lambda f: {**real_meta(f), "conversations": grown + 64})
    gens.clear()
    trainer.run_recipe("qwen2.5-coder-1.5b", w, log=logs.append)
    assert [a[2] for a, _ in gens] == [960, 918, 4228, grown, 960, 3840, 4228]
    assert any(f"the {grown} conversations this run began with" in m and f"holds {grown + 64} now" in m for m in logs)
    os.makedirs(tmp_path / "w2" / "falcon-stage4")
    trainer.run_recipe("qwen2.5-coder-1.5b", str(tmp_path / "w2"), log=logs.append)      # a new run: all of them
    assert [a[2] for a, _ in gens][7:] == [960, 918, 4228, grown + 64, 960, 3840, 4228]
    # without vLLM: transformers answers what the file lacks, gen-data writing the answers into it after each shard
    import importlib.util
    real_spec, n_answered = importlib.util.find_spec, len(answered)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_spec(name, *a))
    gens.clear()
    os.makedirs(tmp_path / "w3" / "falcon-stage4")
    trainer.run_recipe("qwen2.5-coder-1.5b", str(tmp_path / "w3"), log=logs.append)
    assert len(answered) == n_answered
    assert [(k["backend"], k["featurizer"], k["save_answers_to"]) for _, k in gens] == [("hf", "hf", None)] * 2 + [
        ("hf", "hf", last), ("hf", "hf", None)] + [("hf", "hf", os.path.join(here, f"{f}-turn2.safetensors")) for f, _, _ in firsts]
    # (a second-turn set continues its first-turn file's conversations)
    assert [os.path.basename(k["answers"]) for _, k in gens[4:]] == [f"{f}.safetensors" for f, _, _ in firsts]
    monkeypatch.setattr(importlib.util, "find_spec", real_spec)
    # --sets 3: a new run of the first three sets (drafter v3's: the third is the set whose states were kept while
    # answering), its stages 1-2 alone and their trees; the run keeps them, and --sets cannot change them later
    gens.clear()
    seen.clear()
    fits.clear()
    w4 = str(tmp_path / "w4")
    os.makedirs(os.path.join(w4, "falcon-stage2"))
    out = trainer.run_recipe("qwen2.5-coder-1.5b", w4, log=logs.append, num_sets=3)
    assert json.load(open(os.path.join(w4, "recipe_sets.json")))["sets"] == sets[:3]
    assert [os.path.basename(a[1]) for a, _ in gens] == sets[:3]
    assert [(c.mode, os.path.basename(c.out_dir), c.extra_data_dir.replace(w4, w)) for c in seen if c != "tune-tree"] \
        == [(m, d, v3) for m in ("falcon", "eagle") for d in (m, f"{m}-stage2")]
    assert [f.drafter for f in fits] == [os.path.join(w4, "falcon-stage2")] and out["drafters"][0] == fits[0].drafter
    with pytest.raises(SystemExit, match=r"began with 3 sets .*--sets applies to a run when it first starts"):
        trainer.run_recipe("qwen2.5-coder-1.5b", w4, log=logs.append, num_sets=4)
    with pytest.raises(SystemExit, match="--sets 8: this recipe has 7 data sets"):
        trainer.run_recipe("qwen2.5-coder-1.5b", str(tmp_path / "w5"), log=logs.append, num_sets=8)
    with pytest.raises(SystemExit, match=r"began with 3 sets .*--sets applies to a run when it first starts"):
        recipe_status.recipe_status("qwen2.5-coder-1.5b", w4, num_sets=4)  # --status reads the run as the run itself would
    # a run that began with fewer sets keeps them (a newer recipe's sets go to a new --work) and trains the stages
    # on those alone (here stages 1-2: drafter v3's run), its trees fitted to the last; one whose set the recipe no
    # longer has is refused
    gens.clear()
    seen.clear()
    fits.clear()
    with open(os.path.join(w, "recipe_sets.json"), "w") as f:
        json.dump({"sets": sets[:3], "counts": {"qwen15-sharegpt-from1296": grown}}, f)
    os.makedirs(os.path.join(w, "falcon-stage2"))
    out = trainer.run_recipe("qwen2.5-coder-1.5b", w, log=logs.append)
    assert [a[2] for a, _ in gens] == [960, 918, 4228]
    assert [(c.mode, os.path.basename(c.out_dir), c.extra_data_dir) for c in seen if c != "tune-tree"] == [
        (m, d, v3) for m in ("falcon", "eagle") for d in (m, f"{m}-stage2")]
    assert [f.drafter for f in fits] == [os.path.join(w, "falcon-stage2")] and out["drafters"][0] == fits[0].drafter
    assert any(m.startswith("qwen15-sharegpt-from1296, qwen15-sharegpt-turn2, ") and "not in the run in " in m
               for m in logs)
    assert any(m.endswith("falcon-stage3: on sets this run began without: not trained in it") for m in logs)
    with open(os.path.join(w, "recipe_sets.json"), "w") as f:
        json.dump({"sets": sets[:3] + ["qwen15-old"], "counts": {"qwen15-sharegpt-from1296": grown}}, f)
    with pytest.raises(SystemExit, match=r"no longer has \['qwen15-old'\]"):
        trainer.run_recipe("qwen2.5-coder-1.5b", w, log=logs.append)
    # a run begun before the sets were kept (its file holds the counts alone): the sets it has begun (here those
    # three: gen-data, stubbed, wrote no manifest for the fourth), kept from then
    for name in sets[:3]:
        os.makedirs(os.path.join(w, "data", name), exist_ok=True)
        with open(os.path.join(w, "data", name, "manifest.json"), "w") as f:
            f.write("{}")
    with open(os.path.join(w, "recipe_sets.json"), "w") as f:
        json.dump({"qwen15-sharegpt-from1296": grown}, f)
    trainer.run_recipe("qwen2.5-coder-1.5b", w, log=logs.append)
    assert json.load(open(os.path.join(w, "recipe_sets.json")))["sets"] == sets[:3]
    with open(os.path.join(w, "recipe_sets.json"), "w") as f:
        json.dump({"sets": sets, "counts": {"qwen15-sharegpt-from1296": grown}}, f)
    # a stage whose drafter is written is kept (a new --work linking v3's trained stages trains stages 3-4 alone)
    seen.clear()
    for d in ("falcon", "falcon-stage2"):
        os.makedirs(os.path.join(w, d), exist_ok=True)
        with open(os.path.join(w, d, "model.safetensors"), "w") as f:
            f.write("")
        with open(os.path.join(w, d, "config.json"), "w") as f:
            json.dump({"falcon": {"extra": {"training": {"heldout": {"top1_by_block_position": [0.4, 0.2]}}}}}, f)
    trainer.run_recipe("qwen2.5-coder-1.5b", w, log=logs.append)
    assert [(c.mode, os.path.basename(c.out_dir), os.path.basename(c.init_from or "")) for c in seen] == [
        ("falcon", "falcon-stage3", "falcon-stage2"), ("falcon", "falcon-stage4", "falcon-stage3"),
        ("eagle", "eagle", ""), ("eagle", "eagle-stage2", "eagle"), ("eagle", "eagle-stage3", "eagle-stage2"),
        ("eagle", "eagle-stage4", "eagle-stage3")]
    assert any(m.endswith("falcon-stage2: trained (its drafter is written): kept") for m in logs)


def test_recipes_train_in_bf16_where_the_device_computes_it_natively(monkeypatch):
    """bf16 autocast on a GPU or a CPU with AVX512-BF16 or AMX; fp32 on a CPU that emulates bf16 (26x slower)."""
    from falcon_vllm.train import recipes
    from falcon_vllm.vllm import capture

    for avx512_bf16, amx, want in [(True, False, True), (False, True, True), (False, False, False)]:
        flags = {"avx512f"} | ({"avx512_bf16"} if avx512_bf16 else set()) | ({"amx_bf16", "amx_tile"} if amx else set())
        monkeypatch.setattr(capture, "cpu_flags", lambda f=flags: f)
        assert recipes.train_bf16("cpu") is want
        assert recipes.train_bf16("cuda") and recipes.train_bf16("cuda:1")


def test_recipe_status_says_where_a_run_stands(tmp_path, capsys, monkeypatch):
    """`train --recipe NAME --work DIR --status` reads the run's files alone: each set's conversations featurized
    (the growing set's count as its answers file holds it until the run fixes it), the time left at the rate of the
    last prefills, the teacher caches (whole or partial), each stage's epoch and step from its checkpoint, the
    trees, and what the run resumes next."""
    import torch

    from falcon_vllm.cli import main as cli_main
    from falcon_vllm.train import recipe_status, recipes
    from falcon_vllm.train.answer_files import answers_meta

    w = tmp_path / "w"

    def shards(name, n, seconds=320.0, written=0, **extra):  # n shards of 64 conversations, 16,000 tokens
        d = w / "data" / name
        d.mkdir(parents=True, exist_ok=True)
        files = [f"shard_{i:05d}.safetensors" for i in range(n)]
        for i, f in enumerate(files):
            (d / f).write_bytes(b"")
            os.utime(d / f, (written + i, written + i))
        (d / "manifest.json").write_text(json.dumps({"shards": [
            {"file": f, "conversations": 64, "tokens": 16000, "featurize_s": seconds, "from_answers": True, **extra}
            for f in files]}))

    def status():
        return recipe_status.recipe_status("qwen2.5-coder-1.5b", str(w))

    real_held = recipes.held   # the fourth set's file part-answered, as the run first meets it (it grows in the tree)
    monkeypatch.setattr(recipe_status, "held", lambda f: 2240 if f.endswith("-from5136.safetensors") else real_held(f))
    lines = status()
    grown = int(answers_meta(os.path.join(recipes.ANSWERS, "qwen15-sharegpt-from1296.safetensors"))["conversations"])
    assert lines[3].startswith("data qwen15-sharegpt-from5136: 0 of 4228 conversations featurized (0 of 67 shards) (")
    assert lines[3].endswith(" (1988 to answer first: qwen15-sharegpt-from5136.safetensors holds 2240)")
    assert lines[4] == (f"data qwen15-sharegpt-from1296: 0 of {grown} conversations featurized (0 of "
                        f"{-(-grown // 64)} shards) (all its answers file holds now; fixed when the run starts)")
    assert lines[-1] == "next: data (run the same train --recipe command to resume)"
    shards("qwen15", 15, written=1000)  # prefilled at 50 tokens/s
    shards("qwen15-code", 2, seconds=640.0, written=2000)  # the last two at 25
    shards("qwen15-sharegpt-from1296", 1, generate_s=900.0, from_answers=False)  # answered: not a prefill's rate
    # a run that began with three sets (the run fixes its sets, and the growing set's count, when it first starts)
    (w / "recipe_sets.json").write_text(json.dumps({"sets": ["qwen15", "qwen15-code", "qwen15-sharegpt-from1296"],
                                                    "counts": {"qwen15-sharegpt-from1296": 128}}))
    (w / "data" / "qwen15" / "teacher_top64_n960_0123abcd.pt").write_bytes(b"")
    (w / "data" / "qwen15-code" / "teacher_top64_n512_partial_0123abcd.pt").write_bytes(b"")
    lines = status()
    assert lines.pop(1) == ("sets qwen15-sharegpt-from5136, qwen15-sharegpt-turn2, qwen15-sharegpt-from1296-turn2, "
                            "qwen15-sharegpt-from5136-turn2: not in this run (it began without them; a new --work "
                            "trains on them)")
    # left: 790 code and 64 ShareGPT conversations of 250 tokens, at the rate of the last 4 prefilled shards
    assert lines[1:6] == ["data qwen15: 960 of 960 conversations featurized (15 of 15 shards)",
                          "data qwen15-code: 128 of 918 conversations featurized (2 of 15 shards)",
                          "data qwen15-sharegpt-from1296: 64 of 128 conversations featurized (1 of 2 shards)",
                          f"data: about {854 * 250 / (64000 / 1920) / 3600:.1f} h left at 33 tokens/s (the last 4 prefilled "
                          "shards; 45 over all 17)",
                          "teacher cache (first set, 960 conversations): built"]
    assert lines[6] == "teacher cache (other sets, 1046 conversations): 512 conversations so far (partial)"
    for d in ("falcon", "falcon-stage2"):
        (w / d).mkdir()
    (w / "falcon" / "model.safetensors").write_bytes(b"")
    torch.save({"state": {"epoch": 1, "step": 700, "history": []}, "total": 2100}, w / "falcon-stage2" / "checkpoint.pt")
    lines = status()
    del lines[1]  # (the set the run began without)
    assert lines[7] == "Falcon falcon: trained"
    assert lines[8].startswith("Falcon falcon-stage2: epoch 1 of 3 done, step 700 of 2100 (checkpoint.pt written ")
    assert lines[8].endswith(" min ago)")  # an older checkpoint, without the steps' time: no time left
    torch.save({"state": {"epoch": 1, "step": 700, "history": []}, "total": 2100, "seconds": 1200.0,
                "timed_steps": 300}, w / "falcon-stage2" / "checkpoint.pt")  # 4 s a step over the steps timed
    lines = status()
    del lines[1]  # (the set the run began without)
    assert lines[8].endswith(" min ago; about 1.6 h left at 4.0 s a step)")  # 1,400 steps left
    # stage 3 trains on the set this run began without: not in its list; its trees come from stage 2
    assert lines[9:] == ["trees falcon-stage2/serving.json: not yet", "EAGLE-1 eagle: not started (5 epochs)",
                         "EAGLE-1 eagle-stage2: not started (3 epochs)",
                         "next: data (run the same train --recipe command to resume)"]
    shards("qwen15-code", 15)
    shards("qwen15-sharegpt-from1296", 2)
    assert status()[-1] == "next: falcon-stage2 (run the same train --recipe command to resume)"
    for d in ("falcon-stage2", "eagle", "eagle-stage2"):
        (w / d).mkdir(exist_ok=True)
        (w / d / "model.safetensors").write_bytes(b"")
    (w / "falcon-stage2" / "serving.json").write_text("{}")
    assert status()[-1] == "next: the last steps (run the same train --recipe command to finish)"
    # the same run had it begun with every set: stages 3-4 and the trees of the last next (after the other sets' data)
    (w / "recipe_sets.json").write_text(json.dumps({"sets": [s["name"] for s in recipes.recipe_sets(
        recipes.RECIPES["qwen2.5-coder-1.5b"])], "counts": {"qwen15-sharegpt-from1296": 128}}))
    assert [ln for ln in status() if "stage3" in ln or "stage4" in ln] == [
        "Falcon falcon-stage3: not started (3 epochs)", "Falcon falcon-stage4: not started (3 epochs)",
        "trees falcon-stage4/serving.json: not yet", "EAGLE-1 eagle-stage3: not started (3 epochs)",
        "EAGLE-1 eagle-stage4: not started (3 epochs)"]
    (w / "recipe_sets.json").write_text(json.dumps({"sets": ["qwen15", "qwen15-code", "qwen15-sharegpt-from1296"],
                                                    "counts": {"qwen15-sharegpt-from1296": 128}}))
    (w / "recipe_log.json").write_text("{}")
    assert cli_main(["train", "--recipe", "qwen2.5-coder-1.5b", "--work", str(w), "--status"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "finished (recipe_log.json)"
    for d in ("eagle", "eagle-stage2"):  # a run with --no-baseline: the baseline never trained
        (w / d / "model.safetensors").unlink()
    (w / "recipe_log.json").write_text('{"baseline": false}')
    assert status()[-1] == ("finished without the EAGLE-1 baseline (--no-baseline; the same command without it "
                            "trains the baseline)")
    (w / "recipe_log.json").write_text('{"baseline": true}')  # (an older log: the baseline's stage was removed)
    assert status()[-1] == "next: eagle (run the same train --recipe command to resume)"
    # a run begun before its sets were kept (counts alone): the sets it has begun, as the run itself keeps them
    (w / "recipe_sets.json").write_text(json.dumps({"qwen15-sharegpt-from1296": 128}))
    assert status()[1].startswith("sets qwen15-sharegpt-from5136, ") and "-turn2: not in this run" in status()[1]
    with pytest.raises(SystemExit, match="--status applies to --recipe only"):
        cli_main(["train", "--status"])


def test_recipe_status_answering_left(tmp_path):
    """--status says how long the answering still to do takes: at the rate of the last four shards answered into
    the sets' directories (the CPU's rate now), else of the last run that grew such a file (its answer tokens per
    conversation and per second), and that no rate is known before one has run; the sets of second turns apart."""
    from falcon_vllm.train import recipe_status
    from falcon_vllm.train.answer_files import write_answers

    sets = [{"name": "a", "answers": str(tmp_path / "a.safetensors")},
            {"name": "b", "answers": str(tmp_path / "b.safetensors")}]

    def lines(counts):
        return recipe_status.answering_lines(str(tmp_path / "w"), sets, counts)

    assert lines([100, 50]) == ["answering: 150 conversations to answer (no rate measured yet)"]
    runs = [{"dtype": "float32", "conversations": 8, "answer_tokens": 800, "seconds": 40.0},
            {"dtype": "bfloat16", "conversations": 10, "answer_tokens": 2000, "seconds": 50.0}]
    write_answers(sets[0]["answers"], [1] * 10, [1] * 10, list(range(11)), {"runs": json.dumps(runs)})
    # 90 + 50 left, 200 answer tokens a conversation at 40 tokens/s: 700 s
    assert lines([100, 50]) == [
        f"answering: about {700 / 3600:.1f} h left for 140 conversations at 40.0 answer tokens/s (200 a "
        "conversation; bfloat16, the last run that answered)"]
    # shards answered into the set's directory: the last four (by when written), 100 tokens a conversation at 50/s
    d = tmp_path / "w" / "data" / "a"
    d.mkdir(parents=True)
    entries = []
    for i, secs in enumerate([1000.0, 20.0, 20.0, 20.0, 20.0]):  # the first ran beside other work
        (d / f"shard_{i:05d}.safetensors").write_bytes(b"")
        os.utime(d / f"shard_{i:05d}.safetensors", (i, i))
        entries.append({"file": f"shard_{i:05d}.safetensors", "conversations": 10, "answer_tokens": 1000,
                        "generate_s": secs})
    (d / "manifest.json").write_text(json.dumps({"shards": entries}))
    assert lines([100, 50]) == [
        f"answering: about {140 * 100 / 50 / 3600:.1f} h left for 140 conversations at 50.0 answer tokens/s (100 a "
        "conversation; the last 4 shards answered)"]
    assert lines([10, 0]) == []
    # a set of second turns: at its own rate (none measured yet), not the first turns'
    sets.append({"name": "a-turn2", "answers": str(tmp_path / "a2.safetensors"), "continues": sets[0]["answers"],
                 "max_turns": 2, "loss_from_turn": 2})
    assert lines([100, 50, 30]) == [
        f"answering: about {140 * 100 / 50 / 3600:.1f} h left for 140 conversations at 50.0 answer tokens/s (100 a "
        "conversation; the last 4 shards answered)", "answering (turn 2): 30 conversations to continue (those with a "
        "later question answered) (no rate measured yet)"]


# the flags of `falcon-vllm train` that are not TrainConfig fields: the command's own
COMMAND_FLAGS = {"--recipe", "--work", "--no-install", "--no-baseline", "--sets", "--status", "--threads"}


def _other_value(action) -> list[str]:
    """Command-line words giving ``action``'s flag a value that is not its default (a switch: the flag alone)."""
    if action.nargs == 0:
        return [action.option_strings[0]]
    if action.choices:
        return [action.option_strings[0], next(c for c in action.choices if c != action.default)]
    if action.type in (int, float):
        return [action.option_strings[0], str((action.default or 2) + 1)]
    return [action.option_strings[0], "1,2"]  # text: a path, a name, or a comma-separated list


def test_train_flags_are_the_train_config_fields(monkeypatch, capsys):
    """`falcon-vllm train` has a flag per TrainConfig field and no other (but its own four), each setting exactly
    its field; with no flag given it trains with the fields' defaults (save_dtype: the command stores bf16)."""
    import argparse
    import importlib
    from dataclasses import fields

    from falcon_vllm import models
    from falcon_vllm.cli import COMMANDS
    from falcon_vllm.train.config import config_from_args

    command = importlib.import_module(COMMANDS["train"][0])
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    flags = {a.option_strings[0]: a for a in p._actions if a.option_strings and a.dest != "help"}
    base = asdict(config_from_args(p.parse_args([])))
    per_field = {f.name: set() for f in fields(TrainConfig)}
    for flag, action in flags.items():
        if flag not in COMMAND_FLAGS:
            cfg = asdict(config_from_args(p.parse_args(_other_value(action))))
            for name in [n for n in cfg if cfg[n] != base[n]]:
                per_field[name].add(flag)
    assert all(len(c) == 1 for c in per_field.values()), {n: c for n, c in per_field.items() if len(c) != 1}
    assert set().union(*per_field.values()) == set(flags) - COMMAND_FLAGS  # every other flag sets a field
    assert per_field["w_dist"] == {"--token-weight"} and per_field["train_draft_head"] == {"--freeze-draft-head"}
    assert per_field["out_dir"] == {"--out"} and per_field["data_dir"] == {"--data"}
    # defaults: no flag given is the dataclass's defaults (the command stores bf16 weights; the API as trained)
    default = config_from_args(p.parse_args(["--out", "o"]))
    assert default == replace(TrainConfig("o"), save_dtype="bfloat16")
    # the command builds the same config (the target filled in) and reports a run stopped to resume later
    seen = []
    monkeypatch.setattr(models, "model_path", lambda *a: "target-dir")
    monkeypatch.setattr(command, "train", lambda cfg: seen.append(cfg) or {"stopped": True, "out": cfg.out_dir,
                                                                          "state": {"epoch": 1, "step": 3}})
    assert command.main(p.parse_args(["--data", "d", "--out", "o", "--stop-after-epochs", "1", "--no-resume"])) == 0
    assert seen == [replace(default, data_dir="d", target_dir="target-dir", stop_after_epochs=1, resume=False)]
    assert "stopped after epoch 1 (step 3)" in capsys.readouterr().out


def test_aux_layers_data_drafter_and_training(tmp_path, target, data):
    """gen-data --aux-layers stores the states entering those target layers; a drafter with aux layers starts
    as the one without (zero projection), also reads H-wide (predicted) features, refuses other widths and
    keeps its aux layers through save/load; training on such data moves the projection, and refuses data
    without the states it asks for."""
    from falcon_vllm.config import FalconConfig
    from falcon_vllm.train.gen_data import featurize_batch

    seqs = [s.tokens.tolist() for s in data]
    masks = [s.loss_mask.int().tolist() for s in data]
    wide = featurize_batch(target, seqs, masks, aux_layers=(1,))
    with torch.inference_mode():
        states = target.base_model(input_ids=data[0].tokens[None], output_hidden_states=True).hidden_states
    assert wide[0].aux_width == 64 and wide[0].features.shape == (len(seqs[0]), 128)
    torch.testing.assert_close(wide[0].hidden.float(), data[0].features.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(wide[0].features[:, 64:].float(), states[1][0], atol=2e-2, rtol=2e-2)
    write_shard(tmp_path / "shard_00000.safetensors", wide[:3])
    (tmp_path / "manifest.json").write_text(json.dumps({"aux_layers": [1],
                                                        "shards": [{"file": "shard_00000.safetensors"}]}))
    back, plain = load_shards(str(tmp_path)), load_shards(str(tmp_path), aux=False)
    assert all(torch.equal(a.features, b.features) and a.aux_width == 64 for a, b in zip(back, wide))
    assert all(torch.equal(a.features, b.hidden) and a.aux_width == 0 for a, b in zip(plain, wide))

    torch.manual_seed(0)
    d = FalconDrafter(FalconConfig.from_target(target.config, k=2, fusion="fc", num_layers=1, aux_layers=(1,)))
    d.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    T = 10
    f = wide[0].features[None, :T].float()
    with torch.no_grad():  # (featurized tokens are inference tensors)
        args = (d.embed(wide[0].tokens[1:T + 1][None]), torch.arange(T)[None], torch.ones(T, T, dtype=torch.bool))
        out_wide = d(args[0], f, *args[1:])[0]
        torch.testing.assert_close(out_wide, d(args[0], f[..., :64], *args[1:])[0])  # zero projection: no effect yet
        with pytest.raises(ValueError, match="width 100"):
            d(args[0], f[..., :100], *args[1:])

    res = train(TrainConfig(str(tmp_path / "aux"), k=2, fusion="fc", epochs=2, batch_size=8, lr=3e-3,
                            eval_every_epoch=False, eval_roots=12, aux_layers=(1,)),
                samples=wide, target=target, log=lambda *a: None)
    assert res["final"]["sim_roots"] > 0
    back = FalconDrafter.from_pretrained(str(tmp_path / "aux"), target.config)
    assert back.config.aux_layers == (1,) and back.aux_proj.weight.abs().sum() > 0
    with pytest.raises(ValueError, match="do not carry the 1 aux states"):
        train(TrainConfig(str(tmp_path / "bad"), k=2, fusion="fc", epochs=1, aux_layers=(1,)),
              samples=data, target=target, log=lambda *a: None)
    from falcon_vllm.train.gen_data import with_aux_states
    from falcon_vllm.train.evaluation import evaluate
    from falcon_vllm.tree import build_tree

    again = with_aux_states(target, data[:3], (1,))  # data made without them, featurized again
    assert all(a.aux_width == 64 and torch.equal(a.tokens, s.tokens) for a, s in zip(again, data))
    torch.testing.assert_close(again[0].features.float(), wide[0].features.float(), atol=2e-2, rtol=2e-2)
    back.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    with pytest.raises(ValueError, match="2 conversations do not carry the 1 aux states"):
        evaluate(back, data[:2], build_tree("chain-2", 2), 2, 64, 4)
    assert evaluate(back, again, build_tree("chain-2", 2), 2, 64, 4)["sim_roots"] > 0
    with pytest.raises(ValueError, match="final hidden states only"):
        FalconReferenceEngine(target, back, "chain-2")


@pytest.mark.parametrize("length", [17, 18])
def test_second_pass_is_the_serving_pass_two(target, data, length):
    """The training-time second pass gives every block the outputs serving's second drafter pass gives it
    (the pass after its root block: true tokens, the first pass's predicted features, the first pass's K/V
    of the earlier blocks), for a 2-layer reversed-order drafter, blocks aligned to each row's end."""
    from falcon_vllm.config import FalconConfig
    from falcon_vllm.drafter import chunk_mask
    from falcon_vllm.train.losses import second_pass

    torch.manual_seed(1)
    k = 2
    d = FalconDrafter(FalconConfig.from_target(target.config, k=k, fusion="fc", num_layers=2, block_order="reversed"))
    d.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    b = make_batch([data[0], data[1]], k, 64, trim=[len(data[0].tokens) - k - 1 - length, 0])
    assert int(b["lengths"][0]) == length
    with torch.no_grad():
        pred, kv = forward(d, b["ids_in"], b["feat_in"], b, with_kv=True)
        pred2, rows = second_pass(d, b["ids_in"], pred, kv, b, k)
        L = length
        assert rows[0, :L].sum() == L - k - L % k and not rows[0, L:].any()
        tok, f = data[0].tokens, data[0].features.float()
        for e in range(L % k + k - 1, L - k, k):  # each full root block's last row; its pass two drafts e+1..e+k
            n = e + 1
            out, kv1 = d(d.embed(tok[1:n + 1][None]), f[None, :n], torch.arange(n)[None], chunk_mask(0, n, k))
            nxt, _ = d(d.embed(tok[n + 1:n + 1 + k][None]), out[:, -k:], (n + torch.arange(k))[None],
                       torch.ones(k, n + k, dtype=torch.bool), kv1)
            torch.testing.assert_close(pred2[0, n:n + k], nxt[0], atol=1e-5, rtol=1e-4)
            assert rows[0, n:n + k].all()


def test_second_pass_loss_trains(tmp_path, target, data):
    """--second-pass adds the second pass's loss: the run trains and records its weight; a negative weight is refused."""
    res = train(TrainConfig(str(tmp_path / "d"), k=2, fusion="fc", epochs=2, batch_size=8, lr=3e-3, glance="none",
                            eval_every_epoch=False, eval_roots=12, second_pass=1.0),
                samples=data, target=target, log=lambda *a: None)
    assert res["final"]["sim_roots"] > 0
    record = json.loads((tmp_path / "d" / "config.json").read_text())["falcon"]["extra"]["training"]
    assert record["second_pass"] == 1.0
    with pytest.raises(ValueError, match="second-pass loss weight"):
        train(TrainConfig(str(tmp_path / "e"), second_pass=-1.0), samples=data, target=target, log=lambda *a: None)


def test_evaluate_causal_context(tmp_path, target, data):
    """evaluate(context="causal") scores each block as vLLM's proposer computes it: the same top-1 as training's
    relaxed mask for a 1-layer drafter (its K/V does not depend on the mask), its own for 2 layers; sim tau is
    the reference engine's either way.  An unknown context is refused."""
    from falcon_vllm.train.evaluation import evaluate
    from falcon_vllm.tree import build_tree

    tree = build_tree("chain-2", 2)
    got = {}
    for layers in (1, 2):
        out = str(tmp_path / f"l{layers}")
        train(TrainConfig(out, k=2, fusion="fc", layers=layers, block_order="reversed", epochs=2, batch_size=8,
                          lr=3e-3, eval_every_epoch=False, eval_roots=4), samples=data, target=target, log=lambda *a: None)
        d = FalconDrafter.from_pretrained(out, target.config)
        d.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
        with torch.no_grad():
            got[layers] = [evaluate(d, data, tree, 2, 64, 4, context=c) for c in ("relaxed", "causal")]
    one, two = got[1], got[2]
    assert one[0]["top1_by_block_position"] == one[1]["top1_by_block_position"]
    assert two[0]["sim_tau"] == two[1]["sim_tau"] and min(two[1]["top1_by_block_position"]) > 0.1
    assert two[0]["top1_by_block_position"] != two[1]["top1_by_block_position"]
    with pytest.raises(ValueError, match="'relaxed' or 'causal'"):
        evaluate(d, data[:1], tree, 2, 64, 4, context="paged")


def test_level_weights(tmp_path, target, data):
    """--level-weights scales each position's losses by the block level its output predicts: level_weights maps
    positions to levels as evaluate counts them (blocks aligned to each row's end); weights (1, 1) give the
    unweighted loss, (1, 0) the loss of the level-1 positions alone; training records them; bad weights are
    refused."""
    from falcon_vllm.config import FalconConfig
    from falcon_vllm.train.losses import level_weights

    b = make_batch(data[:3], 2, 9, trim=[0, 1, 2])                     # rows of 9, 8 and 7 positions
    w = level_weights(b, 2, (1.0, 0.25))
    # a block's outputs come in level order: its first position predicts level 1, its last level k (labels
    # f_{j+k}); a partial first block predicts level k (evaluate's block positions)
    assert w[0].tolist() == [0.25] + [1, 0.25] * 4
    assert w[1, :8].tolist() == [1, 0.25] * 4 and w[2, :7].tolist() == [0.25] + [1, 0.25] * 3
    assert level_weights(b, 2, ()) is None
    torch.manual_seed(0)
    d = FalconDrafter(FalconConfig.from_target(target.config, k=2)).attach_target(
        target.get_input_embeddings(), target.get_output_embeddings())
    b = make_batch(data[:8], 2, 64)
    with torch.no_grad():
        pred = forward(d, b["ids_in"], b["feat_in"], b)
        plain, _ = losses(d, pred, b, b["loss"], 0.1, 0.9)
        ones, _ = losses(d, pred, b, b["loss"], 0.1, 0.9, weights=level_weights(b, 2, (1.0, 1.0)))
        first, _ = losses(d, pred, b, b["loss"], 0.1, 0.9, weights=level_weights(b, 2, (1.0, 0.0)))
        m = b["loss"] & (level_weights(b, 2, (1.0, 0.0)) > 0)
        alone, _ = losses(d, pred, b, m, 0.1, 0.9)
    torch.testing.assert_close(ones, plain)
    torch.testing.assert_close(first * b["loss"].sum() / m.sum(), alone)  # the same terms, over all positions' count
    train(TrainConfig(str(tmp_path / "w"), k=2, fusion="fc", epochs=1, batch_size=8, glance="none",
                      eval_every_epoch=False, eval_roots=4, level_weights=(1.0, 0.5)),
          samples=data, target=target, log=lambda *a: None)
    record = json.loads((tmp_path / "w" / "config.json").read_text())["falcon"]["extra"]["training"]
    assert record["level_weights"] == [1.0, 0.5]
    for bad in ((1.0,), (1.0, -1.0), (0.0, 0.0)):  # k weights, none negative, not all zero
        with pytest.raises(ValueError, match="level-weights"):
            train(TrainConfig(str(tmp_path / "x"), k=2, level_weights=bad), samples=data, target=target,
                  log=lambda *a: None)


def test_gen_data_refuses_bad_counts_and_a_missing_data_file(tmp_path):
    import argparse

    from falcon_vllm.train import gen_command

    p = argparse.ArgumentParser()
    gen_command.add_arguments(p)
    for argv, err in [(["--num-conversations", "-1"], "--num-conversations must be >= 0, got -1"),
                      (["--shard-size", "0"], "--shard-size must be >= 1, got 0"),
                      (["--data", str(tmp_path / "nope.json")], "--data .*nope.json: no such file"),
                      # --answers-only: first turns, or the later turns of --answers FILE's conversations
                      (["--answers-only", "a.safetensors", "--max-turns", "2"], "or with --answers FILE and"),
                      (["--answers-only", "a.safetensors", "--answers", "f.safetensors"], "or with --answers FILE"),
                      (["--answers-only", "a.safetensors", "--backend", "hf"], "none of --backend hf")]:
        with pytest.raises(SystemExit, match=err):
            gen_command.main(p.parse_args(["--target", "tiny", "--out", str(tmp_path / "d"), *argv]))
