"""Tree verification: greedy and exactly lossless sampling (pure torch, no vLLM import).

Vocabulary (as in vLLM's rejection sampler):

* a *node* is a draft token in the static tree (slot ``i + 1`` holds node ``i``); slot 0 is the
  *root*, the pending token that the target sampled last round and is now feeding to itself;
* a node is *accepted* when verification keeps it.  Accepted nodes always form one root-to-node
  path, so a request's outcome is fully described by its *last accepted slot* (0 if none);
* after the last accepted slot exactly one more token is emitted from the target's distribution
  there: the *bonus* token.  When verification stopped because drafts were rejected, the bonus is
  drawn from the residual distribution, so it is also what chain samplers call the "recovered"
  token.  Every round therefore emits ``num_accepted + 1`` tokens.

Inputs shared by the verifiers: ``node_tokens[b, i]`` is the token of slot ``i + 1``;
``target_logits[b, s]`` are the target's logits for the token that *follows* slot s, computed with
the root and s's ancestors as context (one target forward over root + N nodes under an ancestor
mask).

Greedy (temperature 0): the longest root-to-node path whose every token equals the argmax of its
parent's logits (Medusa / EAGLE tree decoding); ties between equally deep paths go to the first
slot.  The output is token-identical to plain greedy decoding.

Sampling: recursive rejection sampling over siblings -- SpecInfer's multi-draft verifier (Miao et
al., ASPLOS 2024), the verifier of EAGLE's trees (Li et al., ICML 2024), and, for drafts drawn
without replacement, Recursive Speculative Decoding (Jeon et al., 2024).  At the current slot u
(starting at the root) let p be the target's processed distribution there and c_1..c_m u's
children in rank order, with tokens t_1..t_m:

* child c_i is accepted with probability ``min(1, p_i(t_i) / q_i(t_i))``; on acceptance the walk
  moves to c_i and starts again with the target's distribution at c_i;
* on rejection ``p_{i+1} = norm(max(p_i - q_i, 0))`` (the residual) and
  ``q_{i+1} = norm(q_i with t_i removed)`` (the law of the next draw without replacement);
* when every child is rejected, or u is a leaf, the bonus token is drawn from the current p.

By induction over the siblings, the emitted token at every position is distributed exactly as the
target's p whatever the drafter proposes, so the output distribution equals the target's
(tests/test_verify.py checks this statistically against an enumerated target distribution).

Deterministic drafts (the drafter's top-m tokens, Falcon's and EAGLE's static trees) are point-mass
proposals ``q_i = delta(t_i)``: c_i is accepted with probability ``p_i(t_i)`` and the residual is
``p_i`` with ``t_i`` zeroed and renormalised.  Chaining these steps is equivalent in law to drawing
one token ``x ~ p`` and accepting the first child whose token is ``x`` (the bonus being ``x`` when
none matches), which is how :func:`sample_verify` implements that case: one draw per depth.

Degenerate inputs never produce NaN: a residual with no mass left (its rejection had probability
zero) leaves p unchanged, and a child whose token has zero draft probability (it cannot have been
drawn from ``q_i``, e.g. a filler token) is skipped without touching p or q, so its target mass
stays in the residual and is emitted through the bonus token.

Differences from the official Falcon code (FALCON_REFERENCE.md 4.8): the official sampler
re-verifies the pending token, reads draft probabilities one slot off, uses the wrong residual row
and disables sibling masking; it is neither lossless nor crash-free.  Here every node's draft
distribution is ``draft_probs[b, parent]`` and the residual is carried across siblings.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from falcon_vllm.tree import DecodingTree

__all__ = ["VerifyResult", "Sampling", "prepare_sampling", "probs_from_logits", "greedy_verify",
           "greedy_verify_argmax", "sample_verify", "output_token_lists"]


# ---------------------------------------------------------------------- result
@dataclass
class VerifyResult:
    """Outcome of verifying one tree per request.

    Attributes:
        accepted_slots: per request, the slots of the accepted nodes in path order (root excluded;
            may be empty).
        bonus_tokens: [B] int64, the token emitted after the last accepted slot.
        num_accepted: [B] int64, ``len(accepted_slots[b])``.
    """

    accepted_slots: list[list[int]]
    bonus_tokens: torch.Tensor
    num_accepted: torch.Tensor

    @property
    def last_slots(self) -> torch.Tensor:
        """[B] int64 deepest accepted slot per request (0 = only the root)."""
        return torch.tensor([p[-1] if p else 0 for p in self.accepted_slots], dtype=torch.long)

    def output_tokens(self, node_tokens: torch.Tensor) -> list[list[int]]:
        """Per request: the accepted node tokens followed by the bonus token."""
        return output_token_lists(self, node_tokens)

    def output_token_ids(self, node_tokens: torch.Tensor, width: int | None = None,
                         pad: int = -1) -> torch.Tensor:
        """[B, width] int64 tokens emitted per request, right-padded with ``pad``.

        ``width`` defaults to ``1 + max(num_accepted)``; vLLM's samplers use ``max_depth + 1`` and
        ``pad = -1`` (its placeholder token id).
        """
        rows = self.output_tokens(node_tokens)
        width = max(len(r) for r in rows) if width is None else width
        if any(len(r) > width for r in rows):
            raise ValueError(f"falcon-vllm: output_token_ids: width {width} is smaller than an output row")
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


def output_token_lists(result: VerifyResult, node_tokens: torch.Tensor) -> list[list[int]]:
    """Batched: ``[node_tokens[b, s - 1] for s in accepted_slots[b]] + [bonus_tokens[b]]`` per request.

    Two device-to-host copies for the whole batch (no per-element ``int()``).
    """
    toks = node_tokens.tolist()
    bonus = result.bonus_tokens.tolist()
    return [[toks[b][s - 1] for s in path] + [bonus[b]] for b, path in enumerate(result.accepted_slots)]


# ---------------------------------------------------------------------- tree tables
class _Tables:
    """Tensors derived from a tree, cached per (tree, device)."""

    def __init__(self, tree: DecodingTree, device: torch.device):
        S = tree.num_slots
        ch = tree.children
        cmax = max(1, max(len(c) for c in ch))
        table = torch.full((S, cmax), -1, dtype=torch.long)
        for s, c in enumerate(ch):
            if c:
                table[s, : len(c)] = torch.tensor(c, dtype=torch.long)
        depth = tree.depth.tolist()
        self.parent = tree.parent.to(device)
        self.depth = tree.depth.to(device)
        self.children = table.to(device)                     # [S, Cmax], -1 padded, rank order
        self.max_depth = tree.max_depth
        self.slots_at = [torch.tensor([s for s in range(S) if depth[s] == d], dtype=torch.long,
                                      device=device) for d in range(tree.max_depth + 1)]
        # most children of any slot at depth d (bounds the sibling loop of sampled drafts)
        self.width_at = [max(len(ch[s]) for s in range(S) if depth[s] == d)
                         for d in range(tree.max_depth + 1)]
        par = tree.parent.tolist()
        paths: list[list[int]] = [[]]
        for s in range(1, S):
            paths.append(paths[par[s]] + [s])
        self.root_paths = paths                              # root_paths[s]: slots root->s, root excluded


_TABLES: "weakref.WeakKeyDictionary[DecodingTree, dict]" = weakref.WeakKeyDictionary()


def _tables(tree: DecodingTree, device: torch.device) -> _Tables:
    per_tree = _TABLES.setdefault(tree, {})
    key = str(device)
    if key not in per_tree:
        per_tree[key] = _Tables(tree, device)
    return per_tree[key]


def _result(tab: _Tables, last: torch.Tensor, bonus: torch.Tensor) -> VerifyResult:
    paths = [list(tab.root_paths[s]) for s in last.tolist()]
    return VerifyResult(paths, bonus.long(), tab.depth.gather(0, last))


def _check_shapes(tree: DecodingTree, node_tokens: torch.Tensor, target_logits: torch.Tensor) -> None:
    B, N = node_tokens.shape
    if N != tree.num_nodes:
        raise ValueError(f"falcon-vllm: node_tokens has {N} nodes per request, the tree has {tree.num_nodes}")
    if target_logits.dim() != 3 or target_logits.shape[:2] != (B, tree.num_slots):
        raise ValueError(f"falcon-vllm: target_logits must be [B={B}, 1+N={tree.num_slots}, V], "
                         f"got {list(target_logits.shape)}")


# ---------------------------------------------------------------------- processing
def _per_request(x, B: int, dtype: torch.dtype, device, default) -> torch.Tensor:
    if x is None:
        return torch.full((B,), default, dtype=dtype, device=device)
    if isinstance(x, torch.Tensor):
        x = x.to(device=device, dtype=dtype).reshape(-1)
        if x.numel() == 1:
            return x.expand(B)
        if x.numel() != B:
            raise ValueError(f"falcon-vllm: per-request parameter has {x.numel()} values for a batch of {B}")
        return x
    return torch.full((B,), x, dtype=dtype, device=device)


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling parameters on the logits' device, with every host-side decision that depends only
    on them taken once, in one host read (a device sync on GPU): whether any row is greedy (or all are),
    whether any row uses top-k (and the largest k) or top-p.  Built by :func:`prepare_sampling`; a tree walk
    reuses it at every depth instead of deciding again."""
    temperature: torch.Tensor        # [B] fp32
    greedy: torch.Tensor             # [B] bool: temperature <= 0
    top_k: torch.Tensor | None       # [B] long, 1 where top-k is off (masked by top_k_on)
    top_k_on: torch.Tensor | None    # [B] bool: 0 < k < V
    top_p: torch.Tensor | None       # [B] fp32
    any_greedy: bool
    all_greedy: bool
    k_max: int                       # largest active k (0: no row uses top-k)
    any_top_p: bool


def prepare_sampling(temperature, top_k, top_p, B: int, V: int, device) -> Sampling:
    """:class:`Sampling` of B rows over a V-token vocabulary (arguments as in :func:`probs_from_logits`)."""
    t = _per_request(temperature, B, torch.float32, device, 1.0)
    greedy = t <= 0
    k = on = p = None
    stats = [greedy.any(), greedy.all()]
    if top_k is not None:
        k = _per_request(top_k, B, torch.long, device, 0)
        on = (k > 0) & (k < V)
        k = torch.where(on, k, torch.ones_like(k))
        stats.append(torch.where(on, k, torch.zeros_like(k)).amax() if B else torch.zeros((), dtype=torch.long))
    if top_p is not None:
        p = _per_request(top_p, B, torch.float32, device, 1.0)
        stats.append((p < 1).any())
    vals = iter(torch.stack([x.to(device=device, dtype=torch.long) for x in stats]).tolist())  # the one host read
    any_greedy, all_greedy = bool(next(vals)), bool(next(vals)) and B > 0
    k_max = int(next(vals)) if top_k is not None else 0
    any_top_p = bool(next(vals)) if top_p is not None else False
    return Sampling(t, greedy, k, on, p, any_greedy=any_greedy, all_greedy=all_greedy, k_max=k_max,
                    any_top_p=any_top_p)


def probs_from_logits(logits: torch.Tensor, temperature, top_k=None, top_p=None, *,
                      sampling: Sampling | None = None) -> torch.Tensor:
    """Target (or drafter) sampling distribution, processed like common engines (vLLM, HF).

    Order: divide by the temperature, then top-k (keep tokens whose logit is >= the k-th largest,
    so ties at the boundary are kept), then top-p (in descending order keep the smallest prefix
    whose mass is >= top_p, i.e. a token is kept iff the mass of the tokens before it is < top_p;
    the argmax is always kept; computed as vLLM's ``apply_top_k_top_p`` does, so that tied tokens at
    the boundary are kept alike), then softmax.

    Args:
        logits: [..., V] float (any float dtype; computed in fp32).  The per-request parameters
            index the first dimension (B); further leading dimensions share their row's settings.
        temperature: float or [B].  Rows with temperature <= 0 get a one-hot at the argmax of the
            raw logits (the T -> 0 limit; greedy verification handles them separately).
        top_k: None, int or [B]; 0 (or >= V) disables it for that row.
        top_p: None, float or [B]; 1.0 disables it for that row.
        sampling: the parameters already prepared (:func:`prepare_sampling`); then the three above are
            ignored and no host read happens here.

    Returns:
        fp32 probabilities with the shape of ``logits``.
    """
    x = logits.float()
    shape = x.shape
    V = shape[-1]
    B = shape[0] if x.dim() > 1 else 1
    x = x.reshape(B, -1, V)
    s = prepare_sampling(temperature, top_k, top_p, B, V, x.device) if sampling is None else sampling
    x = x / torch.where(s.greedy, torch.ones_like(s.temperature), s.temperature)[:, None, None]
    if s.k_max:
        k = s.top_k
        kth = x.topk(s.k_max, dim=-1).values.gather(-1, (k - 1)[:, None, None].expand(B, x.shape[1], 1))
        x = x.masked_fill((x < kth) & s.top_k_on[:, None, None], float("-inf"))
    if s.any_top_p:  # as vLLM computes it (ascending sort, the tail whose mass is <= 1 - p dropped), so that ties
        p = s.top_p  # at the boundary and rounding fall the same way
        sx, idx = x.sort(dim=-1, descending=False)
        cum = sx.softmax(-1).cumsum(-1)
        drop = (cum <= (1 - p)[:, None, None]) & (p < 1)[:, None, None]
        drop[..., -1] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    probs = x.softmax(-1)
    if s.any_greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, logits.float().reshape(B, -1, V).argmax(-1, keepdim=True), 1.0)
        probs = torch.where(s.greedy[:, None, None], onehot, probs)
    return probs.reshape(shape)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] drawn from it: the exponential race argmax(p / E), E ~ Exp(1) i.i.d.
    (E_i / p_i ~ Exp(p_i), and the least of independent exponentials is i with probability p_i / sum p), as
    vLLM's sampler draws.  Unlike ``torch.multinomial`` (whose validity checks read the host twice a call on
    CUDA) it never synchronises.  Zero-probability tokens are never drawn (E is kept above 0)."""
    e = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / e).argmax(-1)


# ---------------------------------------------------------------------- greedy
def _greedy_last(tab: _Tables, node_tokens: torch.Tensor, target_logits: torch.Tensor | None,
                 argmax: torch.Tensor | None = None):
    """(last accepted slot [B], bonus [B]) of greedy verification; loops over depths only."""
    B = node_tokens.shape[0]
    argmax = target_logits.argmax(-1) if argmax is None else argmax       # [B, S]
    ok = torch.zeros(argmax.shape, dtype=torch.bool, device=argmax.device)
    ok[:, 0] = True
    for d in range(1, tab.max_depth + 1):
        slots = tab.slots_at[d]
        par = tab.parent[slots]
        ok[:, slots] = ok[:, par] & (node_tokens[:, slots - 1] == argmax[:, par])
    score = torch.where(ok, tab.depth[None].expand(B, -1), torch.full_like(argmax, -1))
    last = score.argmax(-1)  # first maximal index = first slot among the deepest accepted
    return last, argmax.gather(1, last[:, None]).squeeze(1)


def greedy_verify(tree: DecodingTree, node_tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Greedy tree verification.

    Accepts the longest path whose every node token equals the argmax of the target logits at its
    parent; among equally deep paths the one ending at the lowest slot wins.  The bonus token is
    the argmax at the last accepted slot (the root if nothing was accepted).

    Args:
        tree: the decoding tree.
        node_tokens: [B, N] int64.
        target_logits: [B, 1 + N, V].

    Vectorised over batch and nodes; loops over depths only.
    """
    _check_shapes(tree, node_tokens, target_logits)
    tab = _tables(tree, target_logits.device)
    last, bonus = _greedy_last(tab, node_tokens.to(target_logits.device), target_logits)
    return _result(tab, last, bonus)


def greedy_verify_argmax(tree: DecodingTree, node_tokens: torch.Tensor, target_argmax: torch.Tensor) -> VerifyResult:
    """:func:`greedy_verify` from the target's argmax per slot ([B, 1 + N] int) instead of its logits
    (a serving engine takes the argmax of its whole logits tensor once, without copying rows)."""
    B, N = node_tokens.shape
    if N != tree.num_nodes or tuple(target_argmax.shape) != (B, tree.num_slots):
        raise ValueError(f"falcon-vllm: greedy_verify_argmax: node_tokens [B, {tree.num_nodes}] and target_argmax "
                         f"[B, {tree.num_slots}] expected, got {list(node_tokens.shape)}, {list(target_argmax.shape)}")
    tab = _tables(tree, target_argmax.device)
    last, bonus = _greedy_last(tab, node_tokens.to(target_argmax.device), None, target_argmax.long())
    return _result(tab, last, bonus)


# ---------------------------------------------------------------------- sampling
def _walk_shape(tree: DecodingTree, node_tokens, target_logits, slot_rows) -> tuple[int, int, int]:
    """(B, S = 1 + N, V) of a verification walk over [B, 1 + N, V] logits or flat ones read at ``slot_rows``."""
    if slot_rows is None:
        _check_shapes(tree, node_tokens, target_logits)
        return tuple(target_logits.shape)
    B, S, V = slot_rows.shape[0], tree.num_slots, target_logits.shape[-1]
    if target_logits.dim() != 2 or tuple(slot_rows.shape) != (B, S) or tuple(node_tokens.shape) != (B, S - 1):
        raise ValueError(f"falcon-vllm: sample_verify: flat logits [T, V], slot_rows [B, 1+N={S}] and node_tokens "
                         f"[B, N] expected, got {list(target_logits.shape)}, {list(slot_rows.shape)}, "
                         f"{list(node_tokens.shape)}")
    return B, S, V


def _point_mass_children(p, ch, ch_tok, generator):
    """One depth with point-mass proposals: sequential acceptance == draw x ~ p, take the first child equal to x.

    p [B, V] target probabilities at the current slot; ch [B, Cmax] its children's slots (-1: none), ch_tok
    their tokens.  Returns (found [B] bool, next slot [B], the drawn token x [B])."""
    x = sample_tokens(p, generator)
    match = (ch >= 0) & (ch_tok == x[:, None])
    found = match.any(1)
    nxt = ch.gather(1, match.int().argmax(1, keepdim=True)).squeeze(1)
    return found, nxt, x


def _sampled_children(p, q, ch, ch_tok, width: int, active, u, generator):
    """One depth of recursive rejection over the ``width`` siblings drawn without replacement from ``q``.

    p [B, V] target probabilities; q [B, V] the drafter distribution the children were drawn from; ch, ch_tok
    [B, Cmax] as in :func:`_point_mass_children`; active [B] rows still walking; u [B] current slots.  Each
    rejected sibling leaves the residual ``norm(max(0, p - q))`` and removes its token from q.  Returns
    (found, next slot, x: a draw from the final residual, the bonus where nothing was accepted)."""
    B, dev = p.shape[0], p.device
    q = q.float()
    q = q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
    found = torch.zeros(B, dtype=torch.bool, device=dev)
    nxt = u.clone()
    for i in range(width):
        c, t = ch[:, i], ch_tok[:, i]
        live = active & ~found & (c >= 0)
        pt = p.gather(1, t[:, None]).squeeze(1)
        qt = q.gather(1, t[:, None]).squeeze(1)
        r = torch.rand(B, generator=generator, device=dev)
        drawn = qt > 0                     # else t cannot come from q: skip the child
        acc = live & drawn & (r * qt < pt)  # r < min(1, p/q) without dividing
        found |= acc
        nxt = torch.where(acc, c, nxt)
        rej = (live & drawn & ~acc)[:, None]
        resid = (p - q).clamp_min(0.0)
        rmass = resid.sum(-1, keepdim=True)
        p = torch.where(rej & (rmass > 0), resid / rmass.clamp_min(torch.finfo(p.dtype).tiny), p)
        q_next = q.scatter(1, t[:, None], 0.0)
        q = torch.where(rej, q_next / q_next.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny), q)
    return found, nxt, sample_tokens(p, generator)


def sample_verify(tree: DecodingTree, node_tokens: torch.Tensor, target_logits: torch.Tensor, temperature,
                  top_k=None, top_p=None, draft_probs: torch.Tensor | None = None,
                  generator: torch.Generator | None = None, slot_rows: torch.Tensor | None = None) -> VerifyResult:
    """Exactly lossless tree verification by recursive rejection sampling over siblings.

    See the module docstring for the algorithm (SpecInfer / EAGLE multi-draft verification; Jeon
    et al.'s recursive speculative decoding for drafts drawn without replacement).

    Args:
        tree: the decoding tree.
        node_tokens: [B, N] int64.
        target_logits: [B, 1 + N, V]; or, with ``slot_rows``, a flat [T, V] logits tensor of which
            request b's slot s is row ``slot_rows[b, s]`` (a serving step's logits: each depth of the
            walk reads the B rows it needs, nothing else is copied).
        temperature, top_k, top_p: scalars or [B] per-request values, applied to the target logits
            by :func:`probs_from_logits`.  Requests with temperature <= 0 are verified greedily
            (identical to :func:`greedy_verify` for them).
        draft_probs: None for deterministic drafts (each child is a point-mass proposal, e.g. the
            drafter's top-m tokens), or [B, 1 + N, V] where ``draft_probs[b, u]`` is the drafter
            distribution from which u's children were drawn without replacement, in rank order.
            It must be the distribution actually sampled from (after the drafter's own
            temperature/top-k/top-p), otherwise the output is not lossless.
        generator: torch.Generator on the logits' device, for reproducible draws.
        slot_rows: [B, 1 + N] int64, see ``target_logits``.

    Returns:
        :class:`VerifyResult`.  The walk is vectorised over the batch; it loops over depths (and,
        for sampled drafts, over sibling ranks) with one host read for the sampling parameters
        (:func:`prepare_sampling`) and one per depth to stop early; its draws (:func:`sample_tokens`)
        read nothing.
    """
    dev = target_logits.device
    B, S, V = _walk_shape(tree, node_tokens, target_logits, slot_rows)
    tab = _tables(tree, dev)
    node_tokens = node_tokens.to(dev)
    sp = prepare_sampling(temperature, top_k, top_p, B, V, dev)   # the walk's one host read before the loop
    greedy = sp.greedy

    def argmax_last():  # greedy rows: their last accepted slot and bonus
        if slot_rows is None:
            return _greedy_last(tab, node_tokens, target_logits)
        # the argmax of this walk's rows only, one slot at a time (B rows copied at once, as a depth reads)
        am = torch.stack([target_logits[slot_rows[:, s]].argmax(-1) for s in range(S)], 1)
        return _greedy_last(tab, node_tokens, None, am)

    if sp.all_greedy:
        return _result(tab, *argmax_last())
    if draft_probs is not None and draft_probs.shape != (B, S, V):
        raise ValueError(f"falcon-vllm: draft_probs must be [B, 1+N, V] = {[B, S, V]}, got {list(draft_probs.shape)}")

    rows = torch.arange(B, device=dev)
    u = torch.zeros(B, dtype=torch.long, device=dev)           # current slot
    active = torch.ones(B, dtype=torch.bool, device=dev)       # still walking
    bonus = torch.zeros(B, dtype=torch.long, device=dev)
    for d in range(tab.max_depth + 1):
        at = target_logits[rows, u] if slot_rows is None else target_logits[slot_rows[rows, u]]
        p = probs_from_logits(at, None, sampling=sp)                          # [B, V]
        ch = tab.children[u]                                                  # [B, Cmax]
        ch_tok = node_tokens.gather(1, (ch - 1).clamp_min(0))                 # [B, Cmax]
        if draft_probs is None:
            found, nxt, x = _point_mass_children(p, ch, ch_tok, generator)
        else:
            found, nxt, x = _sampled_children(p, draft_probs[rows, u], ch, ch_tok, tab.width_at[d], active, u,
                                              generator)
        stop = active & ~found
        bonus = torch.where(stop, x, bonus)
        u = torch.where(active & found, nxt, u)
        active = active & found
        if not bool(active.any()):
            break
    if sp.any_greedy:
        g_last, g_bonus = argmax_last()
        u = torch.where(greedy, g_last, u)
        bonus = torch.where(greedy, g_bonus, bonus)
    return _result(tab, u, bonus)
