"""The training ablation's held-out scoring (benchmarks/train_ablation.py): simulated tau of several
trees from one set of rank profiles, per-root acceptance, and paired differences between variants."""

import os
import sys

import pytest
import torch

from falcon_vllm.testing import random_drafter, tiny_llama
from falcon_vllm.train.gen_data import Sample, generate_and_featurize

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import train_ablation  # noqa: E402

torch.set_num_threads(1)


def test_sim_tau_per_root_and_nested_trees():
    target = tiny_llama(vocab=64, seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (5,), generator=g).tolist() for _ in range(3)]
    samples = [Sample(s.tokens.long(), s.loss_mask.bool(), s.features)
               for s in generate_and_featurize(target, prompts, 40, 0, set())]
    d = random_drafter(target, k=2, fusion="fc").attach_target(target.get_input_embeddings(),
                                                                target.get_output_embeddings())
    out = train_ablation.sim_tau_trees(d, samples, ["chain-4", "chain-8", "falcon-llama"], max_roots=30)
    assert out["roots"] == 30
    for name in ("chain-4", "chain-8", "falcon-llama"):
        acc = out[name]["accepted"]
        assert len(acc) == 30 and out[name]["sim_tau"] == round(1 + sum(acc) / 30, 4)
    # every root accepts at least as much on a tree that contains another (chain-4 in chain-8)
    assert all(a8 >= a4 for a4, a8 in zip(out["chain-4"]["accepted"], out["chain-8"]["accepted"]))
    assert all(a <= 4 for a in out["chain-4"]["accepted"])


def test_paired_diff():
    mean, se = train_ablation.paired_diff([2, 1, 3, 0], [1, 1, 1, 1])
    assert mean == pytest.approx(0.5)
    d = [1, 0, 2, -1]
    assert se == pytest.approx((sum((x - 0.5) ** 2 for x in d) / 3 / 4) ** 0.5)
    assert train_ablation.paired_diff([1, 2], [1]) is None  # different roots: no pairing
