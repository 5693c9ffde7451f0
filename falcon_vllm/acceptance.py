"""What a drafter gets right along the target's own path, and the tau a tree makes of it.

A **rank profile** is measured at a root position of a sequence the target generated greedily: the
SAR drafting passes follow the *true* continuation (pass 1 from the true features; each later block
fed the true tokens of its levels and the features its ancestor block predicted, exactly as in
serving), and the rank of each true token in its drafter row is recorded.  A tree node ``[r1..rd]``
is accepted under greedy verification iff the true ranks start with ``r1..rd``, so its acceptance
probability is the fraction of roots whose profile has that prefix, and the expected tokens per step
is ``tau(tree) = 1 + sum over nodes of P(node)``.

Example (k = 2): profiles ``(0, 0, 1)`` and ``(1,)`` on the tree ``{(0,), (0, 0)}`` accept 2 and 0
draft tokens: tau = 1 + (2 + 0) / 2 = 2.0.

Used by ``falcon-vllm tune-tree`` (:mod:`falcon_vllm.tune_tree`) and by the trainer's held-out
evaluation (:mod:`falcon_vllm.train.evaluation`).
"""

from __future__ import annotations

from collections import Counter

import torch

from falcon_vllm.drafter import FalconDrafter, chunk_mask


@torch.inference_mode()
def rank_profile(drafter: FalconDrafter, tokens: torch.Tensor, feats: torch.Tensor, max_depth: int,
                 topk: int = 10, roots: list[int] | None = None) -> list[tuple[int, ...]]:
    """True-path rank sequences of one sequence.

    Args:
        tokens: [L] int64 tokens of a target-greedy sequence; feats: [L, H] target features.
        roots: committed lengths n to test (default: every 4th position with room for max_depth).
    Returns: one rank tuple per root (stops at the first true token outside the top-``topk``).
    """
    k = drafter.config.k
    L = tokens.shape[0]
    roots = roots or list(range(max(k, 2), L - max_depth - 1, 4))
    out = []
    for n in roots:
        # drafter positions 0..n-1 read (x_{j+1}, f_j); last k form the prediction block
        ids = tokens[1:n + 1][None]
        dev = tokens.device
        out_f, kv = drafter(drafter.embed(ids), feats[:n][None], torch.arange(n, device=dev)[None],
                            chunk_mask(0, n, k, device=dev))
        rows = out_f[0, -k:]
        ranks: list[int] = []
        past = kv
        level = 0
        while level < max_depth:
            cand = drafter.topk_tokens(rows, topk)  # [k, topk]
            ok = True
            for r in range(k):
                if level >= max_depth:
                    break
                true = int(tokens[n + 1 + level])
                hit = (cand[r] == true).nonzero()
                if hit.numel() == 0:
                    ok = False
                    break
                ranks.append(int(hit[0, 0]))
                level += 1
            if not ok or level >= max_depth:
                break
            # next SAR block: the true tokens of the last k levels, features predicted by this block
            blk_ids = tokens[n + 1 + level - k: n + 1 + level][None]
            pos = (n + level - k + torch.arange(k, device=dev))[None]
            mask = torch.ones(k, past[0][0].shape[2] + k, dtype=torch.bool, device=dev)
            nxt, kv = drafter(drafter.embed(blk_ids), rows[None], pos, mask, past)
            past = [(torch.cat([a, c], 2), torch.cat([b, d], 2)) for (a, b), (c, d) in zip(past, kv)]
            rows = nxt[0]
        out.append(tuple(ranks))
    return out


def best_tree(profiles: list[tuple[int, ...]], num_nodes: int) -> tuple[list[list[int]], float]:
    """The ``num_nodes`` tree nodes with the highest empirical acceptance, and the expected tau."""
    counts: Counter = Counter()
    for ranks in profiles:
        for d in range(1, len(ranks) + 1):
            counts[ranks[:d]] += 1
    total = max(1, len(profiles))
    # ties broken by depth then path so the result is deterministic and prefix-closed
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[:num_nodes]
    chosen = {p for p, _ in ranked}
    # prefix-closure (ties at equal count could pick a child before its parent)
    for p in list(chosen):
        for d in range(1, len(p)):
            chosen.add(p[:d])
    paths = sorted(chosen, key=lambda t: (len(t), t))
    tau = 1.0 + sum(counts[p] for p in paths) / total
    return [list(p) for p in paths], tau


def accepted_length(ranks: tuple[int, ...], nodes: set) -> int:
    """Draft tokens a tree (its node set of rank paths) accepts on a root with true-path ``ranks``."""
    a = 0
    while a < len(ranks) and tuple(ranks[:a + 1]) in nodes:
        a += 1
    return a


def mean_tau(accepted) -> float:
    """Tokens per step (the bonus token included) of roots that accepted ``accepted`` draft tokens each."""
    return 1.0 + sum(accepted) / max(1, len(accepted))


def cross_fit_accepted(profiles: list[tuple[int, ...]], num_nodes: int, folds: int = 2) -> list[int]:
    """Accepted draft tokens per root of the best ``num_nodes``-node tree, scored on roots it was not fitted
    on: the profiles are dealt into ``folds`` folds and each fold is scored by the tree fitted on the others
    (``best_tree``'s own tau, fitted and scored on the same roots, is optimistic).  Roots in fold order."""
    accepted = []
    for f in range(folds):
        fit = [p for i, p in enumerate(profiles) if i % folds != f]
        paths, _ = best_tree(fit, num_nodes)
        nodes = {tuple(p) for p in paths}
        accepted += [accepted_length(p, nodes) for i, p in enumerate(profiles) if i % folds == f]
    return accepted


def cross_fit_tau(profiles: list[tuple[int, ...]], num_nodes: int, folds: int = 2) -> float:
    """Tau (bonus token included) of the best ``num_nodes``-node tree on roots it was not fitted on."""
    return mean_tau(cross_fit_accepted(profiles, num_nodes, folds))


def standard_error(xs) -> float:
    """Standard error of the mean (nan below two values)."""
    n = len(xs)
    if n < 2:
        return float("nan")
    m = sum(xs) / n
    return (sum((x - m) ** 2 for x in xs) / (n - 1) / n) ** 0.5
