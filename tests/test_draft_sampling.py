"""benchmarks/studies/draft_sampling.py's expected acceptance is what rejection sampling does: a Monte Carlo run of the
rule (draw x from r, accept with probability min(1, p(x) / r(x))) agrees with sum min(p, r), and with p(argmax)
for greedy drafts."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from studies.draft_sampling import expected_acceptance  # noqa: E402


def test_expected_acceptance_matches_rejection_sampling():
    g = torch.Generator().manual_seed(0)
    V, n = 12, 200_000
    target = torch.randn(3, V, generator=g) * 2
    draft = target + torch.randn(3, V, generator=g)
    draft[:, -3:] = float("-inf")  # a truncated head: tokens it cannot propose
    for T, s in ((0.7, 1.0), (1.0, 0.6), (0.5, None)):
        want = expected_acceptance(target, draft, T, s)
        p = torch.softmax(target / T, -1)
        if s is None:
            r = torch.zeros_like(p).scatter_(-1, draft.argmax(-1, keepdim=True), 1.0)
        else:
            r = torch.softmax(draft / (T * s), -1)
        x = torch.multinomial(r, n, replacement=True, generator=g)                   # [3, n] drafts
        accept = torch.rand(3, n, generator=g) < (p.gather(-1, x) / r.gather(-1, x)).clamp(max=1)
        assert torch.allclose(accept.double().mean(-1), want.double(), atol=0.005), (T, s, want)
    same = expected_acceptance(target, target, 0.8, 1.0)
    assert torch.allclose(same, torch.ones(3))                                       # q = p: always accepted
    assert (expected_acceptance(target, draft, 0.7, 1.0) < 1).all()
