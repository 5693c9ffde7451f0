import math

import pytest
import torch

from falcon_vllm.testing import exact_drafter, increment_llama, random_drafter, tiny_llama
from falcon_vllm.tree import DecodingTree
from falcon_vllm.acceptance import (accepted_length, best_tree, cross_fit_accepted, cross_fit_tau, rank_profile,
                                    standard_error)
from falcon_vllm.tune_tree import choose_trees

torch.set_num_threads(1)


def test_best_tree_is_prefix_closed_and_expected_tau():
    profiles = [(0, 0, 0), (0, 0, 1), (0, 1), (1,), (0, 0, 0), ()]
    paths, tau = best_tree(profiles, 3)
    assert paths == [[0], [0, 0], [0, 0, 0]]
    DecodingTree(paths, 1)
    # P([0]) = 4/6, P([0,0]) = 3/6, P([0,0,0]) = 2/6
    assert abs(tau - (1 + 9 / 6)) < 1e-9


def test_cross_fit_tau_scores_roots_the_tree_was_not_fitted_on():
    nodes = {(0,), (0, 0), (1,)}
    assert [accepted_length(p, nodes) for p in [(0, 0, 0), (0, 1), (1, 0), (2,), ()]] == [2, 1, 1, 0, 0]
    # even roots all (0, 0), odd roots all (1, 1): a 2-node tree fitted on one half misses the other
    profiles = [(0, 0), (1, 1)] * 4
    assert best_tree(profiles, 2)[1] == 2.0                  # fitted and scored on the same roots
    assert cross_fit_tau(profiles, 2) == 1.0                 # each half scored by the other half's tree
    mixed = [(0, 0), (0, 0), (1, 1), (1, 1)] * 2              # both halves hold both paths
    assert cross_fit_tau(mixed, 4) == 3.0                    # room for both: every root accepted whole
    assert cross_fit_tau(mixed, 2) == 2.0                    # the two roots of depth 1
    assert cross_fit_accepted(profiles, 2) == [0] * 8        # fold 0 (even roots), then fold 1
    assert abs(standard_error([1, 2, 3, 4]) - (5 / 12) ** 0.5) < 1e-12 and math.isnan(standard_error([1]))
    same = [p for p in [(0, 0, 1), (0, 1), (0, 0, 0), ()] * 3 for _ in range(2)]  # both folds alike
    assert abs(cross_fit_tau(same, 3) - best_tree(same, 3)[1]) < 1e-9  # identical folds: no optimism to remove


def test_rank_profile_exact_drafter_is_all_zero():
    tgt = increment_llama()
    d = exact_drafter(tgt, k=2)
    d.attach_target(tgt.get_input_embeddings(), tgt.get_output_embeddings())
    seq = torch.arange(3, 40) % 128
    with torch.inference_mode():
        feats = tgt.base_model(input_ids=seq[None]).last_hidden_state[0]
    prof = rank_profile(d, seq, feats, max_depth=6, topk=4)
    assert prof and all(p == (0,) * 6 for p in prof)


def test_choose_trees_shrinks_with_batch():
    profiles = [(0, 0, 0, 0)] * 6 + [(1, 0)] * 2 + [()] * 2
    # verification cost grows with total tokens B * W beyond a knee of 16 tokens
    cost = lambda B, W: 1.0 + max(0, B * W - 16) * 0.05  # noqa: E731
    res = choose_trees(profiles, cost, [1, 64], [1, 2, 4, 6], k=2, draft_pass_cost=0.01)
    assert res[1]["num_nodes"] >= 4 and res[1]["speedup_model"] > 1
    assert res[64]["num_nodes"] == 0 and res[64]["speedup_model"] == 1.0  # never slower than plain


def test_choose_trees_drafts_only_where_the_modelled_gain_reaches_min_gain():
    profiles = [(0,)] * 5 + [()] * 5  # a 1-node tree: tau 1.5
    cost = lambda B, W: 1.0 if W == 1 else 1.4  # noqa: E731  (modelled gain 1.5 / 1.4 = 1.07)
    drafted = choose_trees(profiles, cost, [4], [1], k=2, draft_pass_cost=0.0)[4]
    assert drafted["paths"] == [[0]] and abs(drafted["speedup_model"] - 1.5 / 1.4) < 1e-9
    kept = choose_trees(profiles, cost, [4], [1], k=2, draft_pass_cost=0.0, min_gain=1.1)[4]
    assert kept["paths"] == [] and kept["num_nodes"] == 0 and kept["speedup_model"] == 1.0
    assert kept["fitted"] == {"paths": [[0]], "speedup_model": drafted["speedup_model"]}
    cheap = lambda B, W: 1.0 if W == 1 else 1.2  # noqa: E731  (gain 1.25: drafted under the margin too)
    assert choose_trees(profiles, cheap, [4], [1], k=2, draft_pass_cost=0.0, min_gain=1.1)[4]["paths"] == [[0]]


def test_rank_profile_random_drafter_runs():
    tgt = tiny_llama()
    d = random_drafter(tgt, k=3)
    d.attach_target(tgt.get_input_embeddings(), tgt.get_output_embeddings())
    seq = torch.randint(0, 128, (30,))
    with torch.inference_mode():
        feats = tgt.base_model(input_ids=seq[None]).last_hidden_state[0]
    prof = rank_profile(d, seq, feats, max_depth=6, topk=128)
    assert all(len(p) == 6 for p in prof)  # top-128 of 128: every true token has a rank


def test_held_out_roots_are_spread_over_the_conversations(monkeypatch):
    import falcon_vllm.train.evaluation as tt
    from falcon_vllm.train.gen_data import Sample
    from falcon_vllm.train.evaluation import root_profiles

    seen = []

    def fake_profile(drafter, tokens, feats, depth, topk, roots):
        seen.append((int(tokens[0]), list(roots)))
        return [()] * len(roots)

    monkeypatch.setattr(tt, "rank_profile", fake_profile)
    # 6 conversations of 100 tokens, the answer from position 10: 27 candidate roots each (10, 13, .., 88)
    samples = [Sample(torch.full((100,), i), torch.arange(100) >= 10, torch.zeros(100, 4)) for i in range(6)]
    profiles = root_profiles(None, samples, 2, 8, 10, 24, "cpu")
    assert len(profiles) == 24
    assert [c for c, _ in seen] == list(range(6))           # every conversation contributes, not the first one
    for _, roots in seen:
        assert len(roots) == 4 and roots == sorted(roots)
        assert roots[0] == 10 and roots[-1] >= 60               # evenly spaced over the answer
        assert all(r % 3 == 1 and r < 100 - 8 - 1 for r in roots)


def test_sizes_are_checked_before_any_work():
    from falcon_vllm.tune_tree import sizes

    assert sizes("1,2,4", "--batch-sizes") == [1, 2, 4]
    for bad in ("2,4,", "0,2", "a", ""):
        with pytest.raises(ValueError, match="--widths must be positive integers"):
            sizes(bad, "--widths")
