"""Held-out metrics of a drafter: per-block-position top-1 accuracy, and the simulated tau of a tree (the
longest tree path matching the target's greedy continuation, drafted exactly as in serving from true
features; see :mod:`falcon_vllm.acceptance`).  The trainer reports them after each epoch and at the end.
"""

from __future__ import annotations

import torch

from falcon_vllm.acceptance import accepted_length, cross_fit_accepted, mean_tau, rank_profile, standard_error
from falcon_vllm.drafter import block_offsets, causal_context_mask
from falcon_vllm.train.data import check_aux, make_batch, to_device
from falcon_vllm.train.losses import forward


@torch.inference_mode()
def evaluate(drafter, samples, tree, k: int, max_len: int, max_roots: int = 120, best_widths=(),
             context: str = "relaxed"):
    """Held-out per-block-position top-1 accuracy and simulated tau of ``tree``; with ``best_widths``,
    also the simulated tau of the best tree of each of those sizes, fitted to half of the roots and
    scored on the other half (``acceptance.cross_fit_accepted``; rank profiles to depth 8, top-10 ranks).  Each
    sim tau comes with its standard error over the roots.  ``context`` "causal": the top-1 of each block as
    vLLM's proposer computes it (the positions before the block with causal K/V: ``causal_context_mask``);
    "relaxed": as training computes it (every block relaxed)."""
    if context not in ("relaxed", "causal"):
        raise ValueError(f"falcon-vllm: evaluate(context=) is 'relaxed' or 'causal', got {context!r}")
    if not drafter.config.aux_layers:
        samples = [s.without_aux() for s in samples]
    check_aux(drafter.config.aux_layers, samples, drafter.config.hidden_size)
    drafter.eval()
    dev = next(drafter.parameters()).device
    out = {"top1_by_block_position": top1_by_block_position(drafter, samples, k, max_len, context, dev)}
    out.update(simulated_tau(drafter, samples, tree, k, max_roots, best_widths, dev))
    drafter.train()
    return out


@torch.inference_mode()
def top1_by_block_position(drafter, samples, k: int, max_len: int, context: str, dev) -> list[float]:
    """Share of answer positions whose drafter top-1 is the teacher's token, by offset inside the (end-aligned)
    block: ``k`` values, rounded to 4 places."""
    correct = torch.zeros(k)
    total = torch.zeros(k)
    for s in samples:
        b = to_device(make_batch([s], k, max_len), dev)
        L = int(b["lengths"][0])
        if context == "causal":  # [block copy ; causal copy]: the block copy comes first, so `lengths` orders it
            ids, feats = b["ids_in"].repeat(1, 2), b["feat_in"].repeat(1, 2, 1)
            pos = torch.arange(L, device=dev).repeat(2)[None]
            pred = drafter(drafter.embed(ids), feats, pos, causal_context_mask(L, k, dev)[None],
                           lengths=b["lengths"])[0][0, :L]
        else:
            pred = forward(drafter, b["ids_in"], b["feat_in"], b)[0]
        sel = b["loss"][0, :L]
        teacher = b["t_arg"][0, :L] if "t_arg" in b else drafter.target_logits(b["feat_lbl"][0, :L]).argmax(-1)
        hit = torch.zeros(L, dtype=torch.bool, device=dev)
        hit[sel] = drafter.topk_tokens(pred[:L][sel], 1)[:, 0] == teacher[sel]
        hit, sel = hit.cpu(), sel.cpu()
        r = block_offsets(L, k)[0]  # offset inside its (end-aligned) block
        for o in range(k):
            m = sel & (r == o)
            correct[o] += (hit & m).sum()
            total[o] += m.sum()
    return [round(x, 4) for x in (correct / total.clamp(min=1)).tolist()]


@torch.inference_mode()
def simulated_tau(drafter, samples, tree, k: int, max_roots: int, best_widths, dev) -> dict:
    """{"sim_tau", "sim_tau_se", "sim_roots"} of ``tree`` on the held-out roots and, with ``best_widths``, the
    cross-fitted tau of the best tree of each of those sizes ({"best_tree_sim_tau", "best_tree_sim_tau_se":
    {width: value}, "best_tree_roots"})."""
    nodes = set(tree.nodes)
    profiles = root_profiles(drafter, samples, k, tree.max_depth, max(tree.topk, 1), max_roots, dev)
    accepted = [accepted_length(p, nodes) for p in profiles]
    out = {"sim_tau": round(mean_tau(accepted), 4), "sim_tau_se": round(standard_error(accepted), 4),
           "sim_roots": len(accepted)}
    if best_widths:  # roots with room for depth 8 (the named tree's roots need room for its own depth)
        deep = root_profiles(drafter, samples, k, 8, 10, max_roots, dev)
        fits = {int(w): cross_fit_accepted(deep, int(w)) for w in best_widths}
        out["best_tree_sim_tau"] = {w: round(mean_tau(a), 4) for w, a in fits.items()}
        out["best_tree_sim_tau_se"] = {w: round(standard_error(a), 4) for w, a in fits.items()}
        out["best_tree_roots"] = len(deep)
    return out


def root_profiles(drafter, samples, k: int, depth: int, topk: int, max_roots: int, dev) -> list:
    """Rank profiles (``acceptance.rank_profile``) at answer positions with ``depth`` tokens after them (every 3rd
    such position), at most ``max_roots`` in all, spread over the conversations: each conversation gives at
    most ceil(max_roots / conversations) of its positions, evenly spaced (roots of one conversation are
    correlated: the first ``max_roots`` in order would come from a handful of conversations)."""
    cands = []
    for s in samples:
        cands.append(list(range(max(s.answer_start(), k), len(s.tokens) - depth - 1, 3)))
    n = sum(1 for c in cands if c)
    per = -(-max_roots // max(1, n))
    profiles = []
    for s, rs in zip(samples, cands):
        if not rs or len(profiles) >= max_roots:
            continue
        if len(rs) > per:
            rs = [rs[(i * len(rs)) // per] for i in range(per)]
        rs = rs[: max_roots - len(profiles)]
        profiles += rank_profile(drafter, s.tokens.to(dev), s.features.to(dev).float(), depth, topk, rs)
    return profiles
