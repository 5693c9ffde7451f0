"""Tree verification: greedy and exactly lossless sampling (pure torch).

Vocabulary (as in vLLM's rejection sampler): a draft token is *accepted* when verification keeps
it; after the last accepted node one more token is emitted from the target's distribution there:
the *bonus* token (after a rejection it is drawn from the residual distribution, which makes it the
"recovered" token of chain samplers).

``target_logits[b, s]`` are the target's logits for the token that follows slot s (slot 0 = the
root / pending token, slot i = node i - 1), i.e. computed with s's ancestors as context.

Greedy: the longest path whose every token equals the argmax of its parent's logits.

Sampling: recursive rejection sampling over siblings (SpecInfer, Miao et al. 2024; EAGLE's
multi-draft verifier; Jeon et al. 2024 "Recursive Speculative Decoding" for drafts drawn without
replacement).  At the current node u with target distribution p, the children c_1..c_m (rank
order) are tried in turn: c_i is accepted with probability min(1, p(t_i) / q_i(t_i)); on rejection
p <- norm(max(p - q_i, 0)) and q_{i+1} <- q_i with t_i removed, renormalised.  Deterministic top-k
drafts are point-mass proposals (q_i = delta(t_i)), so acceptance is p(t_i) and the residual is p
with t_i removed.  Whatever the drafter, the emitted token at every step is distributed exactly as
p: the output distribution equals the target's (tested statistically in tests/test_verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from falcon_vllm.tree import DecodingTree


@dataclass
class VerifyResult:
    accepted_slots: list[list[int]]  # per request: slots of accepted nodes in path order (root excluded)
    bonus_tokens: torch.Tensor       # [B] int64, emitted after the last accepted slot
    num_accepted: torch.Tensor       # [B] int64 = len(accepted_slots[b])

    def output_tokens(self, node_tokens: torch.Tensor) -> list[list[int]]:
        """Accepted node tokens followed by the bonus token, per request."""
        return [[int(node_tokens[b, s - 1]) for s in path] + [int(self.bonus_tokens[b])]
                for b, path in enumerate(self.accepted_slots)]


def _per_request(x, B: int, dtype, default):
    if x is None:
        return torch.full((B,), default, dtype=dtype)
    if isinstance(x, torch.Tensor):
        return x.to(dtype).reshape(-1).expand(B) if x.numel() == 1 else x.to(dtype)
    return torch.full((B,), x, dtype=dtype)


def probs_from_logits(logits: torch.Tensor, temperature, top_k=None, top_p=None) -> torch.Tensor:
    """Temperature, then top-k, then top-p (smallest set with mass >= top_p; the argmax always kept).

    Args:
        logits: [B, V] (or [B, S, V]) float.
        temperature: float or [B] (must be > 0 here); top_k: int or [B], 0/None = off;
        top_p: float or [B], 1.0/None = off.
    Returns: fp32 probabilities of the same shape.
    """
    squeeze = logits.dim() == 2
    x = logits.float()
    if squeeze:
        x = x[:, None]
    B, V = x.shape[0], x.shape[-1]
    t = _per_request(temperature, B, torch.float32, 1.0)
    if (t <= 0).any():
        raise ValueError("probs_from_logits: temperature must be > 0 (use greedy verification for 0)")
    x = x / t[:, None, None]
    k = _per_request(top_k, B, torch.long, 0)
    if (k > 0).any():
        kk = torch.where(k > 0, k.clamp(max=V), torch.full_like(k, V))
        sorted_x = x.sort(dim=-1, descending=True).values
        kth = sorted_x.gather(-1, (kk - 1)[:, None, None].expand(B, x.shape[1], 1))
        x = x.masked_fill(x < kth, float("-inf"))
    p = _per_request(top_p, B, torch.float32, 1.0)
    if (p < 1).any():
        sx, idx = x.sort(dim=-1, descending=True)
        sp = sx.softmax(-1)
        cum_before = sp.cumsum(-1) - sp  # mass of strictly better tokens
        drop = cum_before >= p[:, None, None]
        drop[..., 0] = False
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sx)
    out = x.softmax(-1)
    return out[:, 0] if squeeze else out


def greedy_verify(tree: DecodingTree, node_tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Longest path whose tokens equal the target argmax at their parents.

    node_tokens [B, N] int64; target_logits [B, 1+N, V].  Loops over depths only.
    """
    B = node_tokens.shape[0]
    argmax = target_logits.argmax(-1)                                  # [B, 1+N]
    parent, depth = tree.parent, tree.depth
    ok = torch.zeros(B, tree.num_slots, dtype=torch.bool)
    ok[:, 0] = True
    for d in range(1, tree.max_depth + 1):
        slots = (depth == d).nonzero().flatten()
        par = parent[slots]
        ok[:, slots] = ok[:, par] & (node_tokens[:, slots - 1] == argmax[:, par])
    # deepest accepted slot; among equal depths the first in slot order
    score = torch.where(ok, depth[None].expand(B, -1), torch.full_like(ok, -1, dtype=torch.long))
    best = score.argmax(-1)  # argmax returns the first maximal index
    paths = [_path_to(tree, int(s)) for s in best]
    bonus = argmax.gather(1, best[:, None]).squeeze(1)
    return VerifyResult(paths, bonus, torch.tensor([len(p) for p in paths], dtype=torch.long))


def _path_to(tree: DecodingTree, slot: int) -> list[int]:
    par = tree.parent
    path = []
    while slot > 0:
        path.append(slot)
        slot = int(par[slot])
    return path[::-1]


def _normalize(p: torch.Tensor) -> torch.Tensor | None:
    s = p.sum()
    return p / s if s > 0 else None


def sample_verify(tree: DecodingTree, node_tokens: torch.Tensor, target_logits: torch.Tensor, temperature,
                  top_k=None, top_p=None, draft_probs: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> VerifyResult:
    """Exact recursive rejection sampling over tree siblings (see module docstring).

    Args:
        node_tokens: [B, N] int64; target_logits: [B, 1+N, V].
        temperature/top_k/top_p: float or [B]; requests with temperature 0 are verified greedily.
        draft_probs: [B, 1+N, V] or None.  ``draft_probs[b, u]`` is the distribution from which
            u's children were drawn without replacement, in rank order.  None = deterministic
            drafts (point masses).
    """
    B = node_tokens.shape[0]
    temp = _per_request(temperature, B, torch.float32, 1.0)
    tk = _per_request(top_k, B, torch.long, 0)
    tp = _per_request(top_p, B, torch.float32, 1.0)
    paths: list[list[int]] = []
    bonus = torch.zeros(B, dtype=torch.long)
    children = tree.children
    for b in range(B):
        if temp[b] <= 0:
            g = greedy_verify(tree, node_tokens[b:b + 1], target_logits[b:b + 1])
            paths.append(g.accepted_slots[0])
            bonus[b] = g.bonus_tokens[0]
            continue
        probs = probs_from_logits(target_logits[b].float(), temp[b:b + 1].expand(target_logits.shape[1]),
                                  tk[b:b + 1].expand(target_logits.shape[1]),
                                  tp[b:b + 1].expand(target_logits.shape[1]))     # [1+N, V]
        u, path = 0, []
        while True:
            p = probs[u].clone()
            q = draft_probs[b, u].float().clone() if draft_probs is not None else None
            moved = False
            for c in children[u]:
                t = int(node_tokens[b, c - 1])
                if q is None:
                    accept_prob = float(p[t])
                else:
                    qt = float(q[t])
                    accept_prob = (1.0 if p[t] > 0 else 0.0) if qt <= 0 else min(1.0, float(p[t]) / qt)
                if float(torch.rand((), generator=generator)) < accept_prob:
                    path.append(c)
                    u, moved = c, True
                    break
                if q is None:
                    p[t] = 0.0
                    p = _normalize(p)
                else:
                    p = _normalize((p - q).clamp_min(0.0))
                    q[t] = 0.0
                    q = _normalize(q)
                if p is None:  # numerically exhausted (cannot happen with exact arithmetic)
                    p = probs[u].clone()
                    break
                if q is None and draft_probs is not None:
                    q = torch.zeros_like(p)  # no draft mass left: later children are never accepted
            if not moved:
                bonus[b] = int(torch.multinomial(p, 1, generator=generator))
                break
        paths.append(path)
    return VerifyResult(paths, bonus, torch.tensor([len(p) for p in paths], dtype=torch.long))
