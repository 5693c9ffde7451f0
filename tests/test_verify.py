"""Tree verification: hand-built greedy cases, logits processing, and statistical losslessness.

The statistical tests run a toy target and a toy drafter over a 6-token vocabulary, draft a real
tree (deterministic top-m drafts, drafts sampled without replacement, and sparse drafts with
filler tokens), verify with :func:`sample_verify` and compare the law of the first L = 3 generated
tokens with the target's exact law (enumerated over all 6**3 continuations) by a Pearson
chi-square test.  Deliberately wrong verifiers must fail the same test.
"""

from __future__ import annotations

import math

import pytest
import torch

from falcon_vllm.tree import DecodingTree, build_tree
from falcon_vllm.verify import (VerifyResult, greedy_verify, output_token_lists, probs_from_logits, sample_tokens,
                                sample_verify)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are tiny: intra-op threads only add synchronisation cost."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def onehot_logits(argmax_rows: list[list[int]], V: int) -> torch.Tensor:
    """[B, S, V] logits whose argmax at (b, s) is argmax_rows[b][s] (vLLM test style)."""
    x = torch.full((len(argmax_rows), len(argmax_rows[0]), V), -5.0)
    for b, row in enumerate(argmax_rows):
        for s, t in enumerate(row):
            x[b, s, t] = 5.0
    return x


CHAIN3 = DecodingTree([[0], [0, 0], [0, 0, 0]], k=1)


# ---------------------------------------------------------------------- greedy, hand-built
def test_greedy_chain_mismatch_at_depth_2():
    nodes = torch.tensor([[1, 2, 3]])
    logits = onehot_logits([[1, 5, 3, 4]], V=8)  # depth-1 ok (1), depth-2 wants 5, got 2
    r = greedy_verify(CHAIN3, nodes, logits)
    assert r.accepted_slots == [[1]]
    assert r.num_accepted.tolist() == [1]
    assert r.bonus_tokens.tolist() == [5]  # target argmax after the accepted node
    assert r.output_tokens(nodes) == [[1, 5]]


def test_greedy_chain_full_acceptance_bonus_from_leaf():
    nodes = torch.tensor([[1, 2, 3]])
    r = greedy_verify(CHAIN3, nodes, onehot_logits([[1, 2, 3, 7]], V=8))
    assert r.accepted_slots == [[1, 2, 3]]
    assert r.bonus_tokens.tolist() == [7]
    assert r.output_tokens(nodes) == [[1, 2, 3, 7]]
    assert r.last_slots.tolist() == [3]


def test_greedy_no_acceptance_bonus_from_root():
    nodes = torch.tensor([[1, 2, 3]])
    r = greedy_verify(CHAIN3, nodes, onehot_logits([[6, 2, 3, 7]], V=8))
    assert r.accepted_slots == [[]] and r.num_accepted.tolist() == [0]
    assert r.output_tokens(nodes) == [[6]]
    assert r.last_slots.tolist() == [0]


def test_greedy_branching_second_sibling_matches():
    tree = DecodingTree([[0], [1], [0, 0], [1, 0]], k=1)  # slots: 1=[0] 2=[1] 3=[0,0] 4=[1,0]
    nodes = torch.tensor([[4, 2, 6, 7]])
    # root argmax 2 -> slot 2; argmax after slot 2 is 7 -> slot 4; bonus = argmax after slot 4
    r = greedy_verify(tree, nodes, onehot_logits([[2, 6, 7, 0, 3]], V=8))
    assert r.accepted_slots == [[2, 4]]
    assert r.output_tokens(nodes) == [[2, 7, 3]]


def test_greedy_batch_of_two_different_outcomes():
    tree = DecodingTree([[0], [1], [0, 0], [1, 0]], k=1)
    nodes = torch.tensor([[4, 2, 6, 7], [4, 2, 6, 7]])
    logits = onehot_logits([[4, 6, 1, 0, 0],    # slot 1 then slot 3 -> full depth, bonus 0
                            [5, 6, 7, 0, 0]],   # nothing -> bonus 5
                           V=8)
    r = greedy_verify(tree, nodes, logits)
    assert r.accepted_slots == [[1, 3], []]
    assert r.num_accepted.tolist() == [2, 0]
    assert r.bonus_tokens.tolist() == [0, 5]
    assert r.output_tokens(nodes) == [[4, 6, 0], [5]]
    assert output_token_lists(r, nodes) == [[4, 6, 0], [5]]
    assert r.output_token_ids(nodes, width=3).tolist() == [[4, 6, 0], [5, -1, -1]]


def test_greedy_duplicate_siblings_deepest_then_first_slot():
    tree = DecodingTree([[0], [1], [1, 0]], k=1)  # slots 1=[0] 2=[1] 3=[1,0]
    # both siblings carry the argmax 3; only slot 2 has a matching child -> the deeper path wins
    nodes = torch.tensor([[3, 3, 4], [3, 3, 4]])
    logits = onehot_logits([[3, 0, 4, 1],
                            [3, 0, 2, 1]], V=6)  # row 1: slot 3 rejected -> tie at depth 1 -> slot 1
    r = greedy_verify(tree, nodes, logits)
    assert r.accepted_slots == [[2, 3], [1]]
    assert r.bonus_tokens.tolist() == [1, 0]


def test_greedy_shape_errors():
    with pytest.raises(ValueError, match="nodes per request"):
        greedy_verify(CHAIN3, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 4, 5))
    with pytest.raises(ValueError, match="target_logits must be"):
        greedy_verify(CHAIN3, torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 5))


# ---------------------------------------------------------------------- logits processing
L124 = torch.log(torch.tensor([1.0, 2.0, 4.0]))


def test_probs_temperature():
    assert torch.allclose(probs_from_logits(L124[None], 1.0), torch.tensor([[1, 2, 4]]) / 7.0)
    w = torch.tensor([1.0, math.sqrt(2.0), 2.0])  # logits / 2 = log(1, sqrt2, 2)
    assert torch.allclose(probs_from_logits(L124[None], 2.0), (w / w.sum())[None])
    assert torch.allclose(probs_from_logits(L124[None], 0.5), torch.tensor([[1, 4, 16]]) / 21.0)


def test_probs_top_k_top_p():
    assert torch.allclose(probs_from_logits(L124[None], 1.0, top_k=2), torch.tensor([[0, 2, 4]]) / 6.0)
    assert torch.allclose(probs_from_logits(L124[None], 1.0, top_k=0), torch.tensor([[1, 2, 4]]) / 7.0)
    # masses 1/7, 2/7, 4/7: top_p 0.5 keeps {4/7}; 0.6 keeps {4/7, 2/7}; 1.0 keeps all
    assert torch.allclose(probs_from_logits(L124[None], 1.0, top_p=0.5), torch.tensor([[0.0, 0, 1]]))
    assert torch.allclose(probs_from_logits(L124[None], 1.0, top_p=0.6), torch.tensor([[0, 1, 2]]) / 3.0)
    assert torch.allclose(probs_from_logits(L124[None], 1.0, top_p=1.0), torch.tensor([[1, 2, 4]]) / 7.0)
    assert torch.allclose(probs_from_logits(L124[None], 1.0, top_p=1e-9), torch.tensor([[0.0, 0, 1]]))
    # temperature, then top-k, then top-p: masses .1 .2 .3 .4; top-k 3 -> 2/9 3/9 4/9; top-p .6 -> {3, 4}
    x = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert torch.allclose(probs_from_logits(x, 1.0, top_k=3, top_p=0.6), torch.tensor([[0, 0, 3, 4]]) / 7.0)
    # T = 0.5 squares the masses: 1 4 9 16 (/30); top-p 0.5 keeps {16/30} ... then 9/30: 16/30 >= .5
    assert torch.allclose(probs_from_logits(x, 0.5, top_p=0.5), torch.tensor([[0.0, 0, 0, 1]]))
    assert torch.allclose(probs_from_logits(x, 0.5, top_p=0.6), torch.tensor([[0, 0, 9, 16]]) / 25.0)


def test_probs_top_k_keeps_ties():
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    e = math.e
    want = torch.tensor([[0.0, e * e, e * e, 0.0]])
    assert torch.allclose(probs_from_logits(x, 1.0, top_k=1), want / want.sum())


def test_probs_per_request_and_shapes():
    x = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]]))
    out = probs_from_logits(x, torch.tensor([1.0, 0.5, 0.0]), top_k=torch.tensor([0, 2, 0]),
                            top_p=torch.tensor([1.0, 1.0, 0.3]))
    assert torch.allclose(out[0], torch.tensor([1, 2, 3, 4]) / 10.0)
    assert torch.allclose(out[1], torch.tensor([0, 0, 9, 16]) / 25.0)
    assert torch.equal(out[2], torch.tensor([1.0, 0, 0, 0]))  # temperature 0: one-hot argmax
    # [B, S, V]: the per-request settings apply to every row of that request; fp32 out of bf16
    x3 = torch.stack([x, x.flip(0)], 0).bfloat16()  # [2, 3, 4]
    out3 = probs_from_logits(x3, torch.tensor([1.0, 2.0]), top_k=torch.tensor([3, 0]))
    assert out3.dtype == torch.float32 and out3.shape == (2, 3, 4)
    for b, (t, k) in enumerate([(1.0, 3), (2.0, 0)]):
        assert torch.allclose(out3[b], probs_from_logits(x3[b], torch.full((3,), t),
                                                         top_k=torch.full((3,), k)))
    assert torch.allclose(probs_from_logits(L124, 1.0), torch.tensor([1, 2, 4]) / 7.0)  # 1-D


# ---------------------------------------------------------------------- sampling: exact cases
def test_sample_temperature_zero_equals_greedy():
    g = torch.Generator().manual_seed(0)
    for tree in (build_tree("tree-3x2x1", 1), build_tree("eagle-small", 1), CHAIN3):
        B, V = 16, 5
        logits = torch.randn(B, tree.num_slots, V, generator=g)
        # tokens mostly equal to the argmax at the parent, so paths get deep
        am = logits.argmax(-1)
        nodes = am[:, tree.parent[1:]].clone()
        flip = torch.rand(B, tree.num_nodes, generator=g) < 0.3
        nodes[flip] = torch.randint(0, V, (int(flip.sum()),), generator=g)
        want = greedy_verify(tree, nodes, logits)
        for dp in (None, torch.softmax(torch.randn(B, tree.num_slots, V, generator=g), -1)):
            got = sample_verify(tree, nodes, logits, 0.0, top_p=0.5, draft_probs=dp, generator=g)
            assert got.accepted_slots == want.accepted_slots
            assert torch.equal(got.bonus_tokens, want.bonus_tokens)
        # mixed batch: greedy rows equal greedy_verify, including with duplicate sibling tokens
        temp = torch.tensor([0.0, 1.0] * (B // 2))
        got = sample_verify(tree, nodes, logits, temp, generator=g)
        for b in range(0, B, 2):
            assert got.accepted_slots[b] == want.accepted_slots[b]
            assert int(got.bonus_tokens[b]) == int(want.bonus_tokens[b])


def test_sample_point_mass_target():
    tree = build_tree("tree-3x2x1", 1)
    B, V = 64, 6
    g = torch.Generator().manual_seed(1)
    logits = torch.full((B, tree.num_slots, V), -1e4)
    logits[..., 2] = 0.0                         # the target always says 2
    nodes = torch.full((B, tree.num_nodes), 4)
    nodes[:, 1] = 2                              # root's second child (slot 2) carries 2
    for dp in (None, torch.full((B, tree.num_slots, V), 1.0 / V)):
        r = sample_verify(tree, nodes, logits, 1.0, draft_probs=dp, generator=g)
        # slot 2 accepted (its children say 4: rejected, p(4) = 0), bonus 2 from the residual
        assert r.accepted_slots == [[2]] * B
        assert r.bonus_tokens.tolist() == [2] * B


def test_sample_degenerate_cases_no_nan():
    tree = DecodingTree([[0], [1]], k=1)
    B, V = 4000, 4
    g = torch.Generator().manual_seed(2)
    # p = q exactly: the first child is always accepted, the residual is empty but never used
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = q.log().expand(B, 3, V).clone()
    nodes = torch.tensor([[3, 1]]).expand(B, 2)
    r = sample_verify(tree, nodes, logits, 1.0, draft_probs=q.expand(B, 3, V), generator=g)
    assert r.accepted_slots == [[1]] * B
    # q(t) = 0 with p(t) > 0 (a filler child that q cannot have drawn): skipped, its mass reaches
    # the output through the bonus token; p = (.5, .5, 0, 0), q = delta(1), children tokens 0, 2
    logits = torch.log(torch.tensor([0.5, 0.5, 0.0, 0.0])).expand(B, 3, V).clone()
    qd = torch.tensor([0.0, 1.0, 0.0, 0.0]).expand(B, 3, V)
    nodes = torch.tensor([[0, 2]]).expand(B, 2)
    r = sample_verify(tree, nodes, logits, 1.0, draft_probs=qd, generator=g)
    assert r.num_accepted.sum() == 0
    frac0 = float((r.bonus_tokens == 0).float().mean())
    assert abs(frac0 - 0.5) < 0.04 and set(r.bonus_tokens.tolist()) == {0, 1}
    # drafter mass exhausted by removals and a top-p that zeroes the drafted tokens
    qd = torch.tensor([0.0, 0.0, 1.0, 0.0]).expand(B, 3, V)
    nodes = torch.tensor([[2, 3]]).expand(B, 2)
    for dp in (None, qd):
        r = sample_verify(tree, nodes, logits, 0.7, top_p=0.9, draft_probs=dp, generator=g)
        assert r.num_accepted.sum() == 0 and set(r.bonus_tokens.tolist()) <= {0, 1}


def test_sample_reproducible_with_generator():
    tree = build_tree("tree-3x2x1", 1)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(32, tree.num_slots, 6, generator=g)
    nodes = torch.randint(0, 6, (32, tree.num_nodes), generator=g)
    dp = torch.softmax(torch.randn(32, tree.num_slots, 6, generator=g), -1)
    outs = [sample_verify(tree, nodes, logits, 0.8, top_k=4, draft_probs=dp,
                          generator=torch.Generator().manual_seed(11)) for _ in range(2)]
    assert outs[0].accepted_slots == outs[1].accepted_slots
    assert torch.equal(outs[0].bonus_tokens, outs[1].bonus_tokens)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor-to-host reads (bool(), int(), .item(), .tolist(), ...): each is a device sync on GPU, as is
    ``torch.multinomial`` (its validity checks read the host twice on CUDA)."""
    READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy", "multinomial"}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += getattr(func, "__name__", "") in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("top_k,top_p", [(None, None), (20, None), (None, 0.9), (20, 0.9)])
def test_sample_walk_reads_the_host_once_per_depth(top_k, top_p):
    """The sampled walk decides top-k / top-p / greedy handling once (prepare_sampling), not at every depth: at
    most one host read per depth (the early stop) plus a constant, whatever the sampling parameters."""
    tree = build_tree("falcon-llama", 2)
    B, V = 8, 100
    logits = 0.1 * torch.randn(B, tree.num_slots, V, generator=torch.Generator().manual_seed(0))
    logits[:, :, 3] += 8.0                       # every draft token 3 is accepted: the walk goes to full depth
    nodes = torch.full((B, tree.num_nodes), 3)
    t = torch.full((B,), 0.7)
    tk = None if top_k is None else torch.full((B,), top_k)
    tp = None if top_p is None else torch.full((B,), top_p)
    with _HostReads() as reads:
        r = sample_verify(tree, nodes, logits, t, tk, tp, generator=torch.Generator().manual_seed(1))
    depth = int(tree.depth.max())
    assert all(len(a) == depth for a in r.accepted_slots)
    assert reads.n <= depth + 1 + 4, reads.n


def test_sample_tokens_draws_from_the_distribution():
    """The exponential race draws each row's token with its probability (chi-square over 40,000 draws of four
    rows, among them a one-hot and one with zeros), never a zero-probability token, reproducibly per generator."""
    p = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.0, 1.0, 0.0, 0.0], [0.7, 0.0, 0.3, 0.0], [0.1, 0.2, 0.3, 0.4]])
    n = 10000
    g = torch.Generator().manual_seed(5)
    draws = torch.stack([sample_tokens(p, g) for _ in range(n)])                   # [n, 4]
    counts = torch.nn.functional.one_hot(draws, 4).sum(0).double()                 # [4 rows, 4 tokens]
    assert counts[p == 0].sum() == 0
    live = p > 0
    chi2 = ((counts - n * p.double()) ** 2 / (n * p.double())).where(live, torch.zeros(())).sum()
    dof = int(live.sum()) - 4
    assert chi2 < 27.9, (chi2, dof)                    # 7 degrees of freedom: exceeded with probability < 0.001
    again = torch.stack([sample_tokens(p, torch.Generator().manual_seed(5)) for _ in range(2)])
    assert torch.equal(again[0], again[1])


def test_sample_walk_reads_flat_logits_in_place():
    """sample_verify over a serving step's flat logits (slot_rows) equals it over the gathered [B, 1+N, V] rows,
    draw for draw, with greedy rows in the batch; malformed shapes are refused."""
    tree = build_tree("falcon-llama", 2)
    g = torch.Generator().manual_seed(3)
    B, V, S = 5, 50, tree.num_slots
    flat = torch.randn(B * S + 7, V, generator=g)
    slot_rows = torch.randperm(B * S + 7, generator=g)[: B * S].view(B, S)
    am = flat.argmax(-1)
    nodes = torch.where(torch.rand(B, S - 1, generator=g) < 0.8, am[slot_rows[:, tree.parent[1:]]],
                        torch.randint(0, V, (B, S - 1), generator=g))
    t = torch.tensor([0.9, 0.0, 1.3, 0.7, 0.0])
    a = sample_verify(tree, nodes, flat[slot_rows], t, top_p=0.95, generator=torch.Generator().manual_seed(9))
    b = sample_verify(tree, nodes, flat, t, top_p=0.95, generator=torch.Generator().manual_seed(9),
                      slot_rows=slot_rows)
    assert a.accepted_slots == b.accepted_slots and torch.equal(a.bonus_tokens, b.bonus_tokens)
    assert max(len(x) for x in a.accepted_slots) >= 2
    with pytest.raises(ValueError, match="slot_rows"):
        sample_verify(tree, nodes, flat, t, slot_rows=slot_rows[:, :-1])


# ---------------------------------------------------------------------- statistical losslessness
V, L = 6, 3
PROMPT = (1, 4)  # the root (pending token) is 4


def _toy_tables():
    g = torch.Generator().manual_seed(1234)
    A = 1.2 * torch.randn(V, V, generator=g)
    B = 0.8 * torch.randn(V, V, generator=g)
    C = 1.2 * torch.randn(V, V, generator=g)
    # indexed [second-last, last]: the target's logits A[last] + B[second-last]; the drafter's
    # distribution (wrong on purpose) softmax(C[last] + 0.3 B[second-last])
    return {"target": A[None, :, :] + B[:, None, :],
            "drafter": torch.softmax(C[None, :, :] + 0.3 * B[:, None, :], -1)}


TOY = _toy_tables()


def _target_logits(prev, last):
    return TOY["target"][prev, last]


def _drafter_probs(prev, last):
    return TOY["drafter"][prev, last]


def _exact_dist(temperature, top_k, top_p) -> torch.Tensor:
    """[V**L] exact law of the first L tokens after PROMPT (index = base-V number, first token most
    significant), under the processed target distribution."""
    seqs = torch.zeros(1, 0, dtype=torch.long)
    mass = torch.ones(1)
    for _ in range(L):
        ctx = torch.cat([torch.tensor(PROMPT).expand(seqs.shape[0], 2), seqs], 1)
        p = probs_from_logits(_target_logits(ctx[:, -2], ctx[:, -1]), temperature, top_k, top_p)
        mass = (mass[:, None] * p).reshape(-1)
        seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(seqs.shape[0])[:, None]], 1)
    return mass


def _draft(tree, prev0, last0, mode, g):
    """Draft the tree for every row: node tokens [n, N], draft probs [n, S, V], context per slot."""
    n, S = prev0.shape[0], tree.num_slots
    last = torch.zeros(n, S, dtype=torch.long)
    prev = torch.zeros(n, S, dtype=torch.long)
    last[:, 0], prev[:, 0] = last0, prev0
    q = torch.zeros(n, S, V)
    nodes = torch.zeros(n, tree.num_nodes, dtype=torch.long)
    for u in range(S):  # parents precede children
        q[:, u] = _drafter_probs(prev[:, u], last[:, u])
        kids = tree.children[u]
        if not kids:
            continue
        m = len(kids)
        if mode == "top":          # the drafter's top-m tokens by rank
            toks = q[:, u].sort(dim=-1, descending=True, stable=True).indices[:, [tree.nodes[c - 1][-1] for c in kids]]
        elif mode == "sampled":    # m draws without replacement, in draw order
            toks = torch.multinomial(q[:, u], m, replacement=False, generator=g)
        else:                      # "sparse": drafter truncated to its top-2, drawn without
            # replacement; further children get filler tokens the drafter gives zero mass
            top2 = q[:, u].topk(2, -1).indices
            qs = torch.zeros_like(q[:, u]).scatter(1, top2, q[:, u].gather(1, top2))
            q[:, u] = qs / qs.sum(-1, keepdim=True)
            drawn = torch.multinomial(q[:, u], min(m, 2), replacement=False, generator=g)
            rest = (q[:, u] == 0).float().sort(dim=-1, descending=True, stable=True).indices[:, : m - drawn.shape[1]]
            toks = torch.cat([drawn, rest], 1)
        for i, c in enumerate(kids):
            nodes[:, c - 1] = toks[:, i]
            last[:, c], prev[:, c] = toks[:, i], last[:, u]
    return nodes, q, _target_logits(prev, last)


def _generate(tree, verifier, n, temperature, top_k, top_p, mode, seed) -> torch.Tensor:
    """[n] outcome index of the first L tokens generated by speculative rounds for n requests."""
    g = torch.Generator().manual_seed(seed)
    out = [[] for _ in range(n)]
    hist = torch.tensor(PROMPT).expand(n, 2).clone()
    while min(len(o) for o in out) < L:
        nodes, q, logits = _draft(tree, hist[:, -2], hist[:, -1], mode, g)
        res = verifier(tree, nodes, logits, temperature, top_k, top_p,
                       draft_probs=None if mode == "top" else q, generator=g)
        emitted = res.output_tokens(nodes)
        for o, e in zip(out, emitted):
            o.extend(e)
        last2 = [e[-2:] if len(e) >= 2 else [h, e[0]] for e, h in zip(emitted, hist[:, -1].tolist())]
        hist = torch.tensor(last2)
    idx = torch.zeros(n, dtype=torch.long)
    for j in range(L):
        idx = idx * V + torch.tensor([o[j] for o in out])
    return idx


def _chi_square(idx: torch.Tensor, dist: torch.Tensor) -> tuple[float, float]:
    """(Pearson statistic, rejection threshold).  Outcomes of zero target probability must never
    occur (they return +inf); outcomes with expected count < 5 are pooled into one cell.  The
    threshold is the chi-square quantile at z = 5 (one-sided tail ~3e-7, Wilson-Hilferty)."""
    n = idx.numel()
    counts = torch.bincount(idx, minlength=dist.numel()).double()
    if counts[dist <= 1e-12].sum() > 0:
        return math.inf, 0.0
    exp = n * dist.double()
    big = exp >= 5
    obs_cells = torch.cat([counts[big], counts[~big & (dist > 1e-12)].sum()[None]])
    exp_cells = torch.cat([exp[big], exp[~big & (dist > 1e-12)].sum()[None]])
    keep = exp_cells > 0
    stat = float(((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum())
    df = int(keep.sum()) - 1
    z = 5.0
    thr = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, thr


def _tv(idx: torch.Tensor, dist: torch.Tensor) -> float:
    emp = torch.bincount(idx, minlength=dist.numel()).double() / idx.numel()
    return 0.5 * float((emp - dist.double()).abs().sum())


def _inverse_cdf(p: list[float], r: float) -> int:
    acc = 0.0
    for v, pv in enumerate(p):
        acc += pv
        if r < acc:
            return v
    return max(v for v, pv in enumerate(p) if pv > 0)


def _list_verifier(residual: bool = True, update_q: bool = True):
    """A plain-Python, one-request-at-a-time recursive rejection sampler (a second, independent
    implementation of the algorithm).  ``residual=False`` or ``update_q=False`` make it WRONG:
    after a rejection it keeps the unmodified target p, or it keeps the draft distribution q
    unchanged (as if the siblings had been drawn with replacement)."""

    def verify(tree, node_tokens, target_logits, temperature, top_k=None, top_p=None,
               draft_probs=None, generator=None):
        B = node_tokens.shape[0]
        probs = probs_from_logits(target_logits, temperature, top_k, top_p).tolist()
        toks = node_tokens.tolist()
        qs = draft_probs.tolist() if draft_probs is not None else None
        unif = torch.rand(B, 2 * tree.num_slots, generator=generator).tolist()
        paths, bonus = [], []
        for b in range(B):
            u, path, r = 0, [], iter(unif[b])
            while True:
                p = probs[b][u]
                q = qs[b][u] if qs is not None else None
                moved = False
                for c in tree.children[u]:
                    t = toks[b][c - 1]
                    qi = q if q is not None else [float(v == t) for v in range(len(p))]  # point mass
                    if qi[t] <= 0:
                        continue
                    if next(r) < min(1.0, p[t] / qi[t]):
                        path.append(c)
                        u, moved = c, True
                        break
                    if residual:
                        res = [max(a - z, 0.0) for a, z in zip(p, qi)]
                        p = [a / sum(res) for a in res] if sum(res) > 0 else p
                    if q is not None and update_q:
                        q = [0.0 if v == t else z for v, z in enumerate(q)]
                        q = [z / sum(q) for z in q] if sum(q) > 0 else q
                if not moved:
                    bonus.append(_inverse_cdf(p, next(r)))
                    break
            paths.append(path)
        return VerifyResult(paths, torch.tensor(bonus), torch.tensor([len(p) for p in paths]))

    return verify


_wrong_no_residual = _list_verifier(residual=False)
_wrong_no_q_update = _list_verifier(update_q=False)


def _wrong_first_child(tree, node_tokens, target_logits, temperature, top_k=None, top_p=None,
                       draft_probs=None, generator=None):
    """WRONG: always accepts the first child (emits the drafter's output)."""
    B = node_tokens.shape[0]
    u, path = 0, []
    while tree.children[u]:
        u = tree.children[u][0]
        path.append(u)
    bonus = probs_from_logits(target_logits[:, u], temperature, top_k, top_p)
    return VerifyResult([list(path) for _ in range(B)], torch.multinomial(bonus, 1, generator=generator)[:, 0],
                        torch.full((B,), len(path)))


TREE = build_tree("tree-3x2x1", 1)
N_SAMPLES = 4000
SETTINGS = {"T1": (1.0, None, None), "T0.7-p0.9": (0.7, None, 0.9), "T0.9-k4": (0.9, 4, None)}


@pytest.mark.parametrize("mode,setting", [(m, s) for m in ("top", "sampled", "sparse") for s in ("T1", "T0.7-p0.9")]
                         + [("sampled", "T0.9-k4")])
def test_sampling_is_lossless(mode, setting):
    """Deterministic top-m drafts, drafts sampled without replacement, and sparse drafts (drafter
    truncated to its top-2, the third root child a zero-mass filler) are all exactly lossless."""
    temperature, top_k, top_p = SETTINGS[setting]
    dist = _exact_dist(temperature, top_k, top_p)
    assert abs(float(dist.sum()) - 1) < 1e-5
    idx = _generate(TREE, sample_verify, N_SAMPLES, temperature, top_k, top_p, mode, seed=100)
    stat, thr = _chi_square(idx, dist)
    assert stat < thr, (stat, thr)
    # convergence: the total-variation distance shrinks as the sample grows
    tv_small, tv_large = _tv(idx[:500], dist), _tv(idx, dist)
    assert tv_large < 0.6 * tv_small, (tv_small, tv_large)


def test_independent_list_implementation_passes():
    """The plain-Python sampler (same algorithm, other code) passes the same test."""
    dist = _exact_dist(1.0, None, None)
    idx = _generate(TREE, _list_verifier(), N_SAMPLES, 1.0, None, None, "sampled", seed=100)
    stat, thr = _chi_square(idx, dist)
    assert stat < thr, (stat, thr)


@pytest.mark.parametrize("mode,setting,wrongs", [
    ("top", "T1", ["no_residual", "first_child"]),
    ("sampled", "T1", ["no_q_update"]),
    ("sampled", "T0.7-p0.9", ["no_residual", "no_q_update", "first_child"]),
], ids=["top-T1", "sampled-T1", "sampled-T0.7-p0.9"])
def test_wrong_verifiers_fail_the_same_test(mode, setting, wrongs):
    """The test has power: same seeds, same sample size, wrong verifiers are rejected.  Keeping q
    unchanged after a rejection only matters for sampled drafts (point masses have no q to update)."""
    temperature, top_k, top_p = SETTINGS[setting]
    dist = _exact_dist(temperature, top_k, top_p)
    for name in wrongs:
        wrong = {"no_residual": _wrong_no_residual, "no_q_update": _wrong_no_q_update,
                 "first_child": _wrong_first_child}[name]
        idx = _generate(TREE, wrong, N_SAMPLES, temperature, top_k, top_p, mode, seed=100)
        stat, thr = _chi_square(idx, dist)
        assert stat > thr, (name, stat, thr)


def test_sampling_lossless_mixed_batch_chain():
    """Per-request settings in one batch (T=1 and T=0.7/top-p 0.9 interleaved) on a chain tree."""
    tree = build_tree("chain-3", 1)
    n = 2 * N_SAMPLES
    temp = torch.tensor([1.0, 0.7]).repeat(N_SAMPLES)
    top_p = torch.tensor([1.0, 0.9]).repeat(N_SAMPLES)
    idx = _generate(tree, sample_verify, n, temp, None, top_p, "sampled", seed=7)
    for j, (t, p) in enumerate([(1.0, None), (0.7, 0.9)]):
        stat, thr = _chi_square(idx[j::2], _exact_dist(t, None, p))
        assert stat < thr, (t, p, stat, thr)


@pytest.mark.parametrize("top_k,top_p", [(None, None), (5, None), (None, 0.8), (20, 0.6), (1, None), (None, 0.01)])
def test_probs_from_logits_equal_vllms_sampling_functions(top_k, top_p):
    """The tree sampler's target distribution (``probs_from_logits``: temperature, top-k, top-p) equals the one vLLM's
    sampler draws from, computed by vLLM's own ``apply_top_k_top_p``, per row, with ties at the top-k boundary."""
    from tests.vllm_util import vllm_probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g) * 3
    logits[:8, :12] = 4.0                                   # ties
    for t in (1.0, 0.7, 1.6):
        want = vllm_probs(logits, t, top_k, top_p)
        got = probs_from_logits(logits, torch.full((64,), t), None if top_k is None else torch.full((64,), top_k),
                                None if top_p is None else torch.full((64,), top_p))
        assert torch.allclose(got, want, atol=1e-6), (t, (got - want).abs().max())
