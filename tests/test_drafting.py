"""The drafting core (falcon_vllm.core.drafting) on plain tensors and a fake drafter: no vLLM engine."""

from types import SimpleNamespace

import pytest
import torch

from falcon_vllm.core.drafting import PADDING_SLOT_ID, FalconDrafting
from falcon_vllm.core.plan import StepPlan
from falcon_vllm.serving import Serving

H, BS = 4, 4  # hidden size, KV block size


class FakeDrafter(FalconDrafting):
    """The core with the adapter's part faked: the drafter's output at a row is its input feature, a draft token
    is 1000 + the row's first feature; every pass's layout is recorded."""

    def __init__(self, k: int = 2, rows: int = 32, device: str = "cpu"):
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.hidden_states = torch.zeros(rows, H, device=device)
        self.device, self.block_size, self.max_model_len = torch.device(device), BS, 64
        self.init_drafting(Serving(k=k))
        self.init_stash(4, H, device, torch.float32, torch.int64)
        self.fuse_chunk = True
        self.layouts = []

    def _relaxed_block_inputs(self, ctx, last, B):
        return self.block_inputs(ctx.query_start[:B], last, ctx.req_ids)

    def _fused_pass(self, ctx, num_tokens, last, ids, feats, positions, known):
        plan = self.plan_fused(num_tokens, ctx.query_start, last, (ids, feats, positions, known), ctx.slots,
                               ctx.seq_lens, ctx.table)
        self.layouts.append(("fused", plan, self.input_ids[:plan.num_rows].clone()))
        return self.block_outputs(self.hidden_states[plan.num_chunk_rows:plan.num_rows].clone(), ids.shape[0])

    def _chunk_pass(self, ctx, num_tokens, positions):
        return  # (Model Runner V2's chunk pass runs before the core's step)

    def _defer(self, ctx, last, B):
        return self.defer_rows_of(ctx.query_start[:B].tolist(), last, ctx.req_ids)

    def _block_pass(self, ctx, ids, feats, positions, writes, extra_len):
        plan = self.plan_block(ctx.table, ids, feats, positions, writes)
        self.layouts.append(("block", plan, self.input_ids[:plan.num_rows].clone()))
        self.passes += 1
        return self.block_outputs(self.hidden_states[:plan.num_rows].clone(), ids.shape[0])

    def _draft(self, rows, sampling, probs, conf):
        return 1000 + rows[..., 0].long()

    def blocks_of(self, req_id, first, stop):
        return []


def _chunk(prop, chunks, table):
    """Write a chunk (per request: (id, first position, rows)) in EAGLE's shifted layout, row j = (x_{j+1}, f_j)
    with x_j = 100 * request + j and f_j = j; returns the step's (ctx, rows N, last rows [B])."""
    ids, pos = [], []
    for r, first, n in chunks:
        pos += list(range(first, first + n))
        ids += [100 * r + j + 1 for j in range(first, first + n)]
    N = len(pos)
    prop.input_ids[:N] = torch.tensor(ids)
    prop.positions[:N] = torch.tensor(pos)
    prop.hidden_states[:N] = torch.tensor(pos, dtype=torch.float32)[:, None].expand(N, H)
    counts = torch.tensor([n for _, _, n in chunks])
    query_start = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    positions = torch.tensor(pos)
    slots = prop.kv_slots(table[torch.searchsorted(query_start[1:], torch.arange(N), right=True)],
                          positions[:, None])
    ctx = SimpleNamespace(query_start=query_start, req_ids=[str(r) for r, _, _ in chunks], table=table,
                          slots=slots, seq_lens=torch.tensor([f + n for _, f, n in chunks], dtype=torch.int32))
    prop.layouts.clear()
    return ctx, N, query_start[1:] - 1


def _step(prop, chunks, table, K=4):
    """Write a chunk (``_chunk``) and draft K tokens."""
    ctx, N, last = _chunk(prop, chunks, table)
    return prop.draft_step(ctx, K, N, last, len(chunks))


def _program(prop, chunks, table, K, pad=0):
    """Write a chunk (``_chunk``), then the chain's host part and its device program, the batch padded by ``pad``
    rows (stale block-table rows, no request, pointing at the chunk's first row)."""
    ctx, N, last = _chunk(prop, chunks, table)
    B = len(chunks)
    dev = prop.device
    ctx.table = torch.cat([table, torch.arange(pad * table.shape[1]).view(pad, table.shape[1])]).to(dev)
    query_start = torch.cat([ctx.query_start[:B], torch.zeros(pad, dtype=torch.long)]).to(dev)
    last = torch.cat([last, torch.zeros(pad, dtype=torch.long)]).to(dev)
    valid = (torch.arange(B + pad) < B).to(dev)
    slots = prop.step_slots(ctx.req_ids + [None] * pad, dev)
    return prop.chain_program(ctx, query_start, last, slots, K, valid=valid)


def test_a_step_plans_causal_relaxed_and_stashed_rows():
    """k = 2.  Step 1 prefills request 0 (positions 0..5) and request 1 (0..2).  Step 2: request 0 verified 6..8
    (two drafts accepted), request 1 only 3 (none accepted), so its relaxed block [2 3] takes row 2 from the
    stash; request 2 arrives with one row at position 5 (its earlier rows are a prefix-cache hit, unknown): its
    block row 4 runs but writes no K/V."""
    prop = FakeDrafter()
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    first = _step(prop, [(0, 0, 6), (1, 0, 3)], table)
    kind, plan, ids = prop.layouts[0]
    assert kind == "fused" and plan.causal.tolist() == [1, 1, 0, 0]          # both have rows before their block
    assert plan.positions.tolist() == [0, 1, 2, 3, 0, 4, 5, 1, 2]            # causal 0..3 and 0, blocks [4 5] [1 2]
    assert first.tolist() == [[1004, 1005, 1004, 1005], [1001, 1002, 1001, 1002]]

    drafts = _step(prop, [(0, 6, 3), (1, 3, 1), (2, 5, 1)], table)
    (kind, plan, ids), (kind2, plan2, ids2) = prop.layouts
    assert plan.chunked.tolist() == [0] and plan.causal.tolist() == [1, 0, 0, 0]  # request 0's row 6 alone is causal
    assert plan.query_start_cpu.tolist() == [0, 1, 3, 5, 7]
    assert plan.positions.tolist() == [6, 7, 8, 2, 3, 4, 5]
    assert ids.tolist() == [7, 8, 9, 103, 104, 206, 206]     # request 1's row 2 from the stash (x_3 = 103)
    assert plan.slot_mapping.tolist() == [6, 7, 8, 18, 19, PADDING_SLOT_ID, 37]  # request 2's unknown row 4: none
    assert plan.seq_lens.tolist() == [7, 9, 4, 6]            # the causal group ends before its block
    # pass 2: one block per request after its relaxed block, fed pass 1's tokens; every row written
    assert kind2 == "block" and plan2.positions.tolist() == [9, 10, 4, 5, 6, 7]
    assert ids2.tolist() == [1007, 1008, 1002, 1003, 1005, 1005] and bool((plan2.slot_mapping >= 0).all())
    assert drafts.tolist() == [[1007, 1008] * 2, [1002, 1003] * 2, [1005, 1005] * 2]
    assert (prop.steps, prop.passes) == (2, 4)                               # ceil(K / k) passes per step


def test_prompt_lookup_for_every_request_defers_the_pass_and_the_next_one_runs_its_rows():
    """A step whose every request has a lookup draft runs no drafter pass: its chunk rows wait in the stash, and
    the next step's fused pass runs them first, causally, before its own chunk."""
    prop = FakeDrafter()
    table = torch.tensor([[0, 1, 2, 3]])
    prop.lookup = SimpleNamespace(falcon_tokens=4)
    prop.step_plan = StepPlan(4, [[7, 7]], [False], 0)                      # every request matched: no chain
    _step(prop, [(0, 0, 5)], table)
    assert prop.layouts == [] and prop.deferred_steps == 1 and prop.steps == 0
    prop.step_plan = StepPlan(4, [[]], [False], 4)
    _step(prop, [(0, 5, 3)], table)
    _, plan, ids = prop.layouts[0]
    assert plan.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]               # deferred 0..4, chunk 5, block [6 7]
    assert plan.causal.tolist() == [1, 0] and ids[:6].tolist() == [1, 2, 3, 4, 5, 6]


def test_draft_confidence_stops_the_chain_and_cuts_each_draft():
    prop = FakeDrafter()
    prop.draft_confidence = 0.5
    conf = iter([torch.tensor([[0.9, 0.8], [0.4, 0.9]]), torch.tensor([[0.6, 0.9], [0.9, 0.9]])])

    def draft(rows, sampling, probs, c):
        c.append(next(conf))
        return 1000 + rows[..., 0].long()

    prop._draft = draft
    chain = _step(prop, [(0, 0, 4), (1, 0, 4)], torch.tensor([[0, 1], [2, 3]]))
    assert prop.cut(chain) == [[1002, 1003], []]  # 0.9 * 0.8 * 0.6 < 0.5: two tokens; 0.4: none
    assert prop.passes == 2                        # request 0's draft still went on after the first block


def test_chain_program_is_the_chain_step_and_padded_rows_change_nothing():
    """Model Runner V2's chain step (``step_slots``, then ``chain_program``) drafts what ``draft_step`` does, pass
    for pass, over two steps (the second takes the stash's rows); a batch padded with two rows drafts the same for
    its real rows, and the padded rows write no K/V in any pass."""
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    steps = [[(0, 0, 6), (1, 0, 3)], [(0, 6, 3), (1, 3, 1)]]
    for k, K in ((2, 4), (3, 5)):
        a, b, c = FakeDrafter(k=k), FakeDrafter(k=k), FakeDrafter(k=k)
        a.fuse_chunk = False
        for chunks in steps:
            want = _step(a, chunks, table, K)
            assert torch.equal(_program(b, chunks, table, K), want)
            padded = _program(c, chunks, table, K, pad=2)
            assert torch.equal(padded[:2], want)
            for (_, x, ids_x), (_, y, ids_y), (_, z, ids_z) in zip(a.layouts, b.layouts, c.layouts, strict=True):
                assert torch.equal(x.slot_mapping, y.slot_mapping) and torch.equal(ids_x, ids_y)
                assert torch.equal(z.slot_mapping[:2 * k], x.slot_mapping) and torch.equal(ids_z[:2 * k], ids_x)
                assert bool((z.slot_mapping[2 * k:] == PADDING_SLOT_ID).all())
            assert len(a.layouts) == -(-K // k)


def test_chain_program_reads_nothing_on_the_host():
    """The chain's device program on the meta device, where a host read (``item``, ``tolist``, a tensor's
    truth value, ``.cpu()``) or an op whose output shape depends on the data (``nonzero``, masked indexing,
    ``bincount``) raises: it runs, with ``draft_confidence`` on; the control, its early stop (a host read by
    design), raises."""
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    for k, K in ((2, 4), (3, 5)):
        prop = FakeDrafter(k=k, device="meta")
        prop.draft_confidence = 0.5

        def draft(rows, sampling, probs, conf):
            conf.append(rows[..., 0].sigmoid())
            return 1000 + rows[..., 0].long()

        prop._draft = draft
        for chunks in ([(0, 0, 6), (1, 0, 3)], [(0, 6, 3), (1, 3, 1)]):
            out = _program(prop, chunks, table, K, pad=1)
            assert out.device.type == "meta" and out.shape == (3, K) and prop.draft_lengths.shape == (3,)
        ctx, N, last = _chunk(prop, [(0, 9, 2), (1, 4, 2)], table)
        slots = prop.step_slots(["0", "1"], "meta")
        with pytest.raises(RuntimeError, match="meta"):
            prop.chain_program(ctx, ctx.query_start[:2].to("meta"), last.to("meta"), slots, K, early_stop=True)


def test_ngram_draft_is_vllms_ngram_draft():
    """The plugin's n-gram matcher (vLLM 0.34 dropped the V1 one the plugin used) gives vLLM 0.32's drafts: the
    longest repeated suffix, its first occurrence, cut at k and at max_model_len; on random short sequences over
    small vocabularies, where suffixes repeat often."""
    import numpy as np

    ngram = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")
    from falcon_vllm.core.lookup import ngram_draft

    rng = np.random.default_rng(0)
    found = 0
    for _ in range(3000):
        T, V = int(rng.integers(0, 40)), int(rng.integers(2, 6))
        tokens = rng.integers(0, V, T).astype(np.int32)
        lo = int(rng.integers(1, 4))
        hi, k, L = int(rng.integers(lo, 7)), int(rng.integers(1, 9)), int(rng.integers(T, T + 10))
        ours = ngram_draft(tokens, lo, hi, L, k).tolist()
        assert ours == ngram._find_longest_matched_ngram_and_propose_tokens(tokens, lo, hi, L, k).tolist()
        found += bool(ours)
    assert found > 1000
