"""Unit-level tests of the states a long-running server reaches: each one failed before its fix.

* ``LookupState.merge`` with sampled chains when every draft of the step is shorter than the chain's K;
* the drafter-K/V gap bookkeeping (``LookupState.gapped``): pruned in every step, kept for a request left out of one
  step, and set whenever the stash drops pending rows unrun;
* a step where vLLM ran no drafter (a request near ``max_model_len``): the scheduler gets no drafts.
"""

from types import SimpleNamespace

import numpy as np
import torch

from falcon_vllm.core.lookup import LookupState
from falcon_vllm.core.plan import StepPlan
from falcon_vllm.core.stash import BlockInputStash
from falcon_vllm.vllm.hooks import plan_v1_step

V, H = 11, 4


def _state(drafts, withheld):
    return LookupState(2, 3, falcon_tokens=3), StepPlan(3, drafts, withheld, 3)


def test_merge_sampled_chains_when_every_draft_is_shorter_than_k():
    """A gapped request (no lookup draft, no chain) beside 1-token lookup drafts: the merged proposals are as wide
    as the longest draft (1), below the chain's K (3).  This raised before the fix."""
    lk, plan = _state([[], [7], [8]], [True, False, False])
    chain = torch.tensor([[1, 2, 3], [4, 5, 6], [1, 1, 1]])
    probs = torch.rand(3, 3, V).softmax(-1)
    drafts, merged = lk.merge(plan, chain, probs)
    assert drafts == [[], [7], [8]]
    assert merged.shape == (3, 1, V)
    assert merged[1, 0].tolist() == torch.nn.functional.one_hot(torch.tensor(7), V).float().tolist()
    assert lk.lookup_drafts == 2 and lk.falcon_drafts == 0


def test_merge_keeps_the_chain_rows_of_requests_without_lookup():
    lk, plan = _state([[], [9, 9, 9, 9]], [False, False])
    probs = torch.rand(2, 3, V).softmax(-1)
    drafts, merged = lk.merge(plan, torch.tensor([[1, 2, 3], [4, 5, 6]]), probs)
    assert drafts == [[1, 2, 3], [9, 9, 9, 9]] and merged.shape == (2, 4, V)
    assert torch.equal(merged[0, :3], probs[0]) and float(merged[0, 3].sum()) == 0.0
    assert merged[1, :, 9].tolist() == [1.0] * 4


def _runner(req_ids, alive):
    B = len(req_ids)
    batch = SimpleNamespace(num_reqs=B, req_ids=list(req_ids), token_ids_cpu=np.zeros((B, 16), dtype=np.int32),
                            num_tokens_no_spec=np.full(B, 4))
    return SimpleNamespace(input_batch=batch, discard_request_mask=SimpleNamespace(np=np.zeros(B, dtype=bool)),
                           max_model_len=64, requests={r: None for r in alive})


def test_gaps_of_finished_requests_are_forgotten_in_steps_that_draft_nothing():
    """A server held at a batch size where the schedule drafts nothing adds a gap per request; before the fix the set
    was pruned only in steps that draft, so it grew without bound."""
    lk = LookupState(2, 3, falcon_tokens=2)
    for i in range(100):
        ids = [f"r{i}", f"s{i}"]
        lk.skipped(ids, alive=ids)         # each step: two new requests, the older ones have finished
    assert lk.gapped == {"r99", "s99"}


def test_a_request_left_out_of_one_step_keeps_its_gap():
    lk = LookupState(2, 3, falcon_tokens=2)
    lk.skipped(["a", "b"], alive=["a", "b"])
    plan = plan_v1_step(lk, _runner(["b"], alive=["a", "b"]), torch.full((1, 1), -1), 2)  # "a" is not scheduled
    assert lk.gapped == {"a", "b"} and plan.withheld == [True] and plan.chain == 0
    plan_v1_step(lk, _runner(["a"], alive=["a"]), torch.full((1, 1), -1), 2)              # "b" finished
    assert lk.gapped == {"a"}


def _piece(first: int, n: int):
    pos = torch.arange(first, first + n)
    return 100 + pos, pos[:, None].float().expand(n, H).clone(), torch.zeros(n, dtype=torch.long), first


def test_stash_reports_every_drop_of_pending_rows():
    """Pending rows that never run leave a gap in the drafter's K/V: take, defer and retain report them."""
    st = BlockInputStash(8, k=2, hidden_size=H, device="cpu", dtype=torch.float32)
    a, b, c = st.slots(["a", "b", "c"], "cpu").tolist()
    for s in (a, b, c):
        assert st.keep(s, _piece(0, 4), cap=16)
    assert st.drain_dropped() == []
    assert st.take([a], [9], [9]) is None                  # a's rows end at 4, its chunk starts at 9: dropped
    assert st.drain_dropped() == ["a"]
    assert st.defer([b], [_piece(10, 2)], cap=16)          # b's new rows do not follow its old ones: replaced
    assert st.drain_dropped() == ["b"]
    st.retain([b])                                          # c is not in this step
    assert st.drain_dropped() == ["c"]
    st.slots(["d"] * 1, "cpu")                              # a fresh request takes a free slot: nothing dropped
    assert st.drain_dropped() == []


def _falcon_runner(lookup, proposed: bool, req_ids=("x", "y")):
    from falcon_vllm.serving import Serving
    from falcon_vllm.vllm.proposer import FalconProposer

    prop = FalconProposer.__new__(FalconProposer)          # the attributes the runner hooks read
    prop.falcon, prop.lookup, prop.proposed, prop.tree_state = Serving(k=2), lookup, proposed, None
    prop._stash, prop._pending_blocks = BlockInputStash(4, k=2, hidden_size=H, device="cpu", dtype=torch.float32), {}
    batch = SimpleNamespace(req_ids=list(req_ids), logprob_token_ids={})
    runner = SimpleNamespace(drafter=prop, input_batch=batch, requests={r: None for r in req_ids})
    prop._runner = runner
    return runner


def test_no_drafts_are_scheduled_after_a_step_where_vllm_ran_no_drafter():
    """Near max_model_len vLLM skips the drafter and hands the scheduler K zero tokens per request; in tree mode
    their width then met the previous step's smaller subtree (a crash).  Now the scheduler gets no drafts, and in
    lookup mode those requests are marked gapped (their verified rows reached no drafter pass)."""
    from falcon_vllm.vllm.tree_verify import _take_draft_token_ids

    zeros = SimpleNamespace(req_ids=["x", "y"], draft_token_ids=[[0] * 40, [0] * 40])
    take = _take_draft_token_ids(lambda self: SimpleNamespace(**vars(zeros)))
    lk = LookupState(2, 3, falcon_tokens=2)
    runner = _falcon_runner(lk, proposed=False)
    assert take(runner).draft_token_ids == [[], []]
    assert lk.gapped == {"x", "y"}
    runner = _falcon_runner(None, proposed=True)              # a step that drafted: its drafts pass through
    drafted = SimpleNamespace(req_ids=["x", "y"], draft_token_ids=[[1, 2], [3]])
    assert _take_draft_token_ids(lambda self: drafted)(runner).draft_token_ids == [[1, 2], [3]]
    assert runner.drafter.proposed is False                 # read once per step


def test_no_drafts_while_a_request_asks_for_given_token_logprobs():
    """Only vLLM's plain sampler returns the logprobs of given token ids (``logprob_token_ids``): such a batch
    verifies no drafts."""
    from falcon_vllm.vllm.tree_verify import _take_draft_token_ids

    runner = _falcon_runner(None, proposed=True)
    runner.input_batch.logprob_token_ids = {"y": [1, 2]}
    drafted = SimpleNamespace(req_ids=["x", "y"], draft_token_ids=[[1, 2], [3]])
    assert _take_draft_token_ids(lambda self: drafted)(runner).draft_token_ids == [[], []]


def test_marked_blocks_leave_the_prefix_cache_before_the_next_step():
    """The runner's marks reach the scheduler's ``evict_blocks`` once; a mark naming a block this pool lacks (left by
    an engine of the same process that has shut down) is dropped, not passed on (vLLM asserts on it)."""
    from falcon_vllm.vllm import prefix_gaps

    got = []
    manager = SimpleNamespace(block_pool=SimpleNamespace(blocks=[None] * 10), evict_blocks=got.append)
    prefix_gaps.DIRTY.clear()
    prefix_gaps.mark([3, 4, 12])
    prefix_gaps.evict(SimpleNamespace(kv_cache_manager=manager))
    prefix_gaps.evict(SimpleNamespace(kv_cache_manager=manager))     # nothing new: no call
    assert got == [{3, 4}] and not prefix_gaps.DIRTY
    state = SimpleNamespace(block_ids=([7, 8, 9],))
    cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))])
    runner = SimpleNamespace(requests={"r": state}, drafter=None, kv_cache_config=cfg)
    assert prefix_gaps.blocks_of(runner, "r", 20) == [8, 9]           # position 20 lies in the second block
    assert prefix_gaps.blocks_of(runner, "r", 0, 16) == [7]
    assert prefix_gaps.blocks_of(runner, "gone", 0) == []
