"""The proposer's per-request stash: pending rows kept by steps with drafting off, and the relaxed block's rows."""

import torch

from falcon_vllm.core.stash import BlockInputStash

H = 4


def _piece(first: int, n: int):
    """Rows at positions first..first+n-1: token 100+q, feature q in every channel, level offset 0."""
    pos = torch.arange(first, first + n)
    return 100 + pos, pos[:, None].float().expand(n, H).clone(), torch.zeros(n, dtype=torch.long), first


def test_kept_rows_join_in_order_and_fill_the_relaxed_block():
    st = BlockInputStash(4, k=3, hidden_size=H, device="cpu", dtype=torch.float32)
    (s,) = st.slots(["a"], "cpu").tolist()
    assert st.keep(s, _piece(0, 5), cap=16)           # a prefill with drafting off
    assert st.keep(s, _piece(5, 1), cap=16)           # then single decode rows
    assert st.keep(s, _piece(6, 1), cap=16)
    assert st.num_rows(s) == 7 and st.max_rows() == 7
    # the next drafting step's chunk is position 7; its relaxed block (5..7) takes 5 and 6 from the stash
    ids, feats = torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, 3, H)
    ids[0, 2], feats[0, 2] = 107, 7.0
    known = st.fill(torch.tensor([s]), ids, feats, torch.tensor([[5, 6, 7]]), torch.tensor([[False, False, True]]))
    assert known.tolist() == [[True, True, True]] and ids[0, :2].tolist() == [105, 106]
    assert feats[0, :2, 0].tolist() == [5.0, 6.0]
    # the pass takes the rows that end where its chunk starts (7), cut before the block (from 5): positions 0..4
    req, got_ids, got_feats, _, pos = st.take([s], [7], [5])
    assert pos.tolist() == list(range(5)) and got_ids.tolist() == [100, 101, 102, 103, 104]
    assert req.tolist() == [0] * 5 and got_feats[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert not st.pending


def test_kept_rows_that_do_not_follow_or_overflow_are_dropped():
    st = BlockInputStash(4, k=2, hidden_size=H, device="cpu", dtype=torch.float32)
    a, b = st.slots(["a", "b"], "cpu").tolist()
    assert st.keep(a, _piece(0, 3), cap=4)
    assert not st.keep(a, _piece(4, 1), cap=4) and a not in st.pending      # position 3 missing: a gap
    assert st.keep(b, _piece(0, 4), cap=4)
    assert not st.keep(b, _piece(4, 1), cap=4) and b not in st.pending      # past the cap
    # deferred rows (steps served by lookup alone) append to kept ones under their own cap, all or nothing
    assert st.keep(a, _piece(10, 2), cap=8) and st.keep(b, _piece(20, 2), cap=8)
    assert not st.defer([a, b], [_piece(12, 1), _piece(22, 3)], cap=4)
    assert st.num_rows(a) == 2 and st.num_rows(b) == 2
    assert st.defer([a, b], [_piece(12, 1), _piece(22, 2)], cap=4) and st.num_rows(a) == 3
    st.retain([b])                                                            # a left the batch
    assert list(st.pending) == [b]
    assert st.take([b], [30], [24]) is None and not st.pending                # not where b's chunk starts
