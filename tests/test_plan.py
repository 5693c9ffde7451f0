"""The step plan both runners follow (falcon_vllm/core/plan.py): each case of the decision, on plain lists."""

from falcon_vllm.core.lookup import LookupState
from falcon_vllm.core.plan import StepPlan, plan_step


def _lookup(falcon_tokens=2, falcon_max_batch=None, gapped=()):
    lk = LookupState(2, 3, falcon_tokens=falcon_tokens, falcon_max_batch=falcon_max_batch)
    lk.gapped.update(gapped)
    return lk


def test_drafting_off_drafts_nothing():
    assert plan_step(0, ["a"], _lookup(), [[5]]) == StepPlan(0, None, None, 0)
    assert plan_step(0, ["a"]) == StepPlan(0, None, None, 0)


def test_without_lookup_the_chain_takes_the_whole_budget():
    assert plan_step(5, ["a", "b"]) == StepPlan(5, None, None, 5)


def test_lookup_caps_the_chain_and_requests_without_a_match_get_it():
    plan = plan_step(8, ["a", "b"], _lookup(falcon_tokens=3), [[7, 7, 7, 7], []])
    assert plan == StepPlan(8, [[7, 7, 7, 7], []], [False, False], 3, False)
    assert not plan.all_matched and not plan.all_withheld


def test_every_request_matched_runs_no_chain():
    plan = plan_step(8, ["a", "b"], _lookup(), [[1], [2, 3]])
    assert plan.chain == 0 and plan.all_matched and not plan.all_withheld


def test_gapped_requests_are_withheld_and_a_step_of_only_them_runs_no_chain():
    plan = plan_step(4, ["a", "b"], _lookup(gapped={"a"}), [[], []])
    assert plan.withheld == [True, False] and plan.chain == 2
    plan = plan_step(4, ["a"], _lookup(gapped={"a"}), [[]])
    assert plan.all_withheld and plan.chain == 0 and not plan.lookup_only


def test_past_falcon_max_batch_lookup_only():
    plan = plan_step(4, ["a", "b", "c"], _lookup(falcon_max_batch=2), [[9], [], []])
    assert plan.lookup_only and plan.withheld == [True] * 3 and plan.chain == 0
    assert not plan_step(4, ["a", "b"], _lookup(falcon_max_batch=2), [[9], []]).lookup_only


def test_a_batch_the_verifier_cannot_serve_drafts_nothing():
    assert plan_step(4, ["a"], _lookup(), [[1]], servable=False) == StepPlan(4, None, None, 0)


def test_merge_follows_the_plan():
    lk = _lookup()
    plan = plan_step(4, ["a", "b", "c"], _lookup(gapped={"c"}), [[7, 8], [], []])
    drafts, _ = lk.merge(plan, [[1, 2], [3, 4], [5, 6]])
    assert drafts == [[7, 8], [3, 4], []]
    assert (lk.lookup_drafts, lk.falcon_drafts) == (1, 1)


def _protocol_methods(proto) -> set[str]:
    return {n for c in proto.__mro__ if c.__module__ == "falcon_vllm.core.adapter"
            for n, v in vars(c).items() if callable(v) and not n.startswith("__")}


def test_both_runners_adapters_define_the_whole_contract():
    """The V1 proposer defines every method of the fusing adapter's contract, the V2 speculator every method of the
    plain one (it never fuses: ``fuse_chunk`` stays off there), each in its own class, not inherited from the core."""
    from falcon_vllm.core.adapter import FusingAdapter, RunnerAdapter
    from falcon_vllm.core.drafting import FalconDrafting
    from falcon_vllm.vllm.proposer import FalconProposer
    from falcon_vllm.vllm.v2.speculator import FalconSpeculator

    need_v1, need_v2 = _protocol_methods(FusingAdapter), _protocol_methods(RunnerAdapter)
    assert {"_block_pass", "_draft_tree"} <= need_v2 < need_v1 and "_fused_pass" in need_v1
    assert need_v1 <= set(vars(FalconProposer)) and need_v2 <= set(vars(FalconSpeculator))
    assert not need_v1 & set(vars(FalconDrafting))  # the core leaves every pass to its adapter
