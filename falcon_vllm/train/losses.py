"""The CSGD objective of one training step: input noise, glancing, the drafter's passes over a batch and
their losses (FALCON_REFERENCE.md §3.3).

- noise on the input features: ``scaled`` U(+-51.2/L) (the official code) or ``fixed`` U(+-0.1) (the paper);
- glancing: N = lambda(epoch) * d positions p, d the Hamming distance between the drafter's and the
  teacher's tokens, get the coupled ground truth (f_{p+k}, x_{p+k+1}) as input;
- the loss: SmoothL1(pred, f_{j+k}) + w_dist * (alpha * soft + (1 - alpha) * CE), soft =
  sum p_T log(softmax(t/T) / softmax(s/T)) with T = 0.95 (the official form), CE against the teacher's
  argmax token; with ``second_pass``, the same loss on the drafter's next pass as serving runs it.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from falcon_vllm.drafter import block_offsets


def lam(epoch: int, epochs: int, schedule: str) -> float:
    """The glancing ratio lambda at ``epoch`` (0-based) of ``epochs`` under ``schedule`` (code or paper)."""
    if schedule == "paper":  # 0.4 (ep_t - ep_c) / ep_t
        return 0.4 * (epochs - epoch) / epochs
    return 0.35 * (epochs - epoch) / epochs + 0.1  # the official code (20 -> epochs)


def glance_positions(pred_ids, teacher_ids, loss, k: int, lam_value: float, mode: str, gen: random.Random,
                     observed=None):
    """Choose positions to replace per sequence.  Returns list of LongTensors (one per sample).

    N = int(lambda * d), d = Hamming distance between drafter and teacher tokens on the loss
    positions.  ``observed`` (default: all loss positions) marks where the drafter's tokens were
    computed; when it is a subset, d is estimated as (errors among observed) * |loss| / |observed|
    and error-driven glancing picks among the observed errors.
    """
    out = []
    for b in range(pred_ids.shape[0]):
        m = loss[b].nonzero().flatten()
        if m.numel() < 2 or mode == "none":
            out.append(torch.zeros(0, dtype=torch.long))
            continue
        o = m if observed is None else observed[b].nonzero().flatten()
        wrong = pred_ids[b, o] != teacher_ids[b, o]
        d = int(wrong.sum()) if o.numel() == m.numel() else round(int(wrong.sum()) * m.numel() / max(1, o.numel()))
        n = int(lam_value * d)
        cand = m[::k] if mode == "uniform" else o[wrong]
        n = min(n, cand.numel())
        out.append(cand[sorted(gen.sample(range(cand.numel()), n))] if n else torch.zeros(0, dtype=torch.long))
    return out


def apply_glance(batch, positions):
    """Replace input (f_p, x_{p+1}) by the coupled ground truth (f_{p+k}, x_{p+k+1}) at each p (without aux
    states: in serving, features the drafter predicted have none)."""
    ids, feats = batch["ids_in"].clone(), batch["feat_in"].clone()
    H = batch["feat_lbl"].shape[-1]
    for b, pos in enumerate(positions):
        if pos.numel():
            ids[b, pos] = batch["lbl_ids"][b, pos]
            feats[b, pos] = 0
            feats[b, pos, :H] = batch["feat_lbl"][b, pos]
    return ids, feats


def add_noise(feats, lengths, mode: str, gen: torch.Generator):
    """``feats`` [B, T, W] plus uniform noise: ``fixed`` U(+-0.1), ``scaled`` U(+-51.2/L) for a row of length L."""
    u = (torch.rand(feats.shape, generator=gen) - 0.5).to(feats.device)
    if mode == "fixed":
        return feats + 0.2 * u  # U(-0.1, 0.1)
    scale = (0.2 * 512 / lengths.clamp(min=1).float())[:, None, None].to(feats.device)  # official: U(+-51.2/L)
    return feats + u * scale


def subsample(mask, limit: int | None, gen: torch.Generator | None = None):
    """A uniformly random subset of at most ``limit`` True positions of ``mask`` (all if limit is None)."""
    n = int(mask.sum())
    if not limit or n <= limit:
        return mask
    idx = mask.flatten().nonzero().flatten()
    keep = idx[torch.randperm(n, generator=gen)[:limit].to(idx.device)]
    out = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    out[keep] = True
    return out.view_as(mask)


def forward(drafter, ids, feats, batch, net=None, with_kv: bool = False):
    """Drafter outputs [B, T, H] of a training batch (and its K/V with ``with_kv``); ``net`` is the module to
    call (a DDP wrapper)."""
    B, T = ids.shape
    pos = torch.arange(T, device=ids.device).expand(B, T)
    out, kv = (net or drafter)(drafter.embed(ids), feats, pos, batch["attn"], lengths=batch["lengths"])
    return (out, kv) if with_kv else out


def second_pass(drafter, ids, pred, kv, batch, k: int, net=None):
    """The drafter's second pass over a training batch, as serving runs it (EAGLE-3's training-time test).

    End-aligned blocks make the block after a root block the one its second pass drafts, so every block
    becomes a second-pass block at once: row j reads its true token x_{j+1} (as drafted tokens are verified
    against) and the feature the first pass predicted for it, ``pred[j - k]`` (detached), and attends to the
    first pass's K/V of the earlier blocks and to its own block's second-pass K/V.  Rows whose source row
    lies before the first full block are left out.  Returns (outputs [B, T, H], rows [B, T] bool)."""
    B, T = ids.shape
    dev = ids.device
    L = batch["lengths"].to(dev)[:, None]
    j = torch.arange(T, device=dev)[None].expand(B, T)
    real = j < L
    blk = torch.where(real, (L - 1 - j) // k, -1)                    # 0 = the last block of the row
    rows = real & (j - k >= L % k)                                    # its source row is in a full block
    feats = torch.zeros_like(pred)
    feats[:, k:] = pred[:, :-k].detach()
    feats = feats * rows[..., None]
    q, c = blk[:, :, None], blk[:, None, :]
    both = real[:, :, None] & real[:, None, :]
    earlier = (c > q) & both
    own = ((c == q) & both) | torch.eye(T, dtype=torch.bool, device=dev)[None]  # padded rows see themselves
    out, _ = (net or drafter)(drafter.embed(ids), feats, j, torch.cat([earlier, own], 2), past=kv,
                              lengths=batch["lengths"])
    return out, rows


def losses(drafter, pred, batch, loss_mask, w_dist: float, alpha: float, T: float = 0.95, token_mask=None,
           weights=None):
    """SmoothL1 on features + w_dist * (alpha * soft + (1 - alpha) * CE); ``weights`` [B, T] (optional) scales
    each position's terms (``level_weights``).

    The LM head (the dominant cost) runs only on ``token_mask`` (default: the loss positions; the
    trainer may pass a random subset of them, an unbiased estimate of the token losses).  The
    teacher comes from the batch's cached top-k (``teacher_cache``) when present, else from the LM
    head on the label features.  soft = sum_v p_T(v) (log softmax(t/T) - log softmax(s/T)) (the
    official form, T = 0.95); CE is against the teacher's argmax token.
    """
    sel = loss_mask
    n = sel.sum().clamp(min=1)
    reg = F.smooth_l1_loss(pred[sel].float(), batch["feat_lbl"][sel], reduction="none").mean(-1)
    tsel = sel if token_mask is None else token_mask
    nt = tsel.sum().clamp(min=1)
    w = None if weights is None else weights[tsel]
    reg = (reg if weights is None else reg * weights[sel]).sum() / n
    s_logits = drafter.logits(pred[tsel]).float()  # [n, V] or [n, N] (truncated head: draft ids)
    s_lse, s_lseT = s_logits.logsumexp(-1), (s_logits / T).logsumexp(-1)
    t2d = drafter.target_to_draft()  # None: draft ids are target ids
    if "t_idx" in batch:  # cached teacher: its top-k target ids and logits
        idx, val = batch["t_idx"][tsel], batch["t_val"][tsel]
        p_t = (val - batch["t_lse"][tsel][:, None]).exp()
        log_t = val / T - batch["t_lseT"][tsel][:, None]
        teacher = batch["t_arg"][tsel]
    else:
        with torch.no_grad():
            t_logits = drafter.target_logits(batch["feat_lbl"][tsel]).float()
            teacher = t_logits.argmax(-1)
            idx = torch.arange(t_logits.shape[-1]).expand_as(t_logits)
            p_t, log_t = t_logits.softmax(-1), torch.log_softmax(t_logits / T, -1)
    # teacher tokens outside a truncated head cannot be drafted: they leave the soft loss and the CE
    d_idx = idx if t2d is None else t2d[idx]
    ok = d_idx >= 0
    log_s = s_logits.gather(1, d_idx.clamp(min=0)) / T - s_lseT[:, None]
    soft = (p_t * (log_t - log_s) * ok).sum(-1)
    d_teacher = teacher if t2d is None else t2d[teacher]
    ce = (s_lse - s_logits.gather(1, d_teacher.clamp(min=0)[:, None])[:, 0]) * (d_teacher >= 0)
    if w is not None:
        soft, ce = soft * w, ce * w
    soft, ce = soft.sum() / nt, ce.sum() / nt
    acc = (drafter.to_target_ids(s_logits.argmax(-1)) == teacher).float().mean()
    return reg + w_dist * (alpha * soft + (1 - alpha) * ce), {"reg": float(reg.detach()), "soft": float(soft.detach()),
                                                               "ce": float(ce.detach()), "acc": float(acc)}


def level_weights(batch, k: int, weights) -> torch.Tensor | None:
    """[B, T] weight of each position's losses by the block level its output predicts (``weights[0]``: the next
    token, level 1; outputs in level order, blocks aligned to each row's end); None for no weights."""
    if not weights:
        return None
    dev = batch["loss"].device
    return torch.tensor(weights, dtype=torch.float32, device=dev)[block_offsets(batch["loss"].shape[1], k,
                                                                                batch["lengths"], dev)]
