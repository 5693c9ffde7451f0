"""``falcon-vllm train``: Coupled Sequential Glancing Distillation (CSGD) for Falcon drafters.

Per step (FALCON_REFERENCE.md §3.3, any batch size here):

1. inputs: position j reads (x_{j+1}, f_j + noise); labels are f_{j+k} (regression) and the
   target's distribution lm_head(f_{j+k}) over x_{j+k+1}; the relaxed mask has blocks aligned to
   the end of each sequence (``chunk_mask``), exactly as the drafter is run;
2. glance pass (no grad): Hamming distance d between the drafter's and the teacher's argmax
   tokens on the loss positions of each sequence;
3. N = lambda(epoch) * d positions p get the coupled ground truth (f_{p+k}, x_{p+k+1}) as input;
4. gradient pass: loss = SmoothL1(pred, f_{j+k}) + w_dist * (alpha * soft + (1 - alpha) * CE),
   soft = sum p_T log(softmax(t/T) / softmax(s/T)) with T = 0.95 (the official form), CE against
   the teacher's argmax token.

Where paper and code disagree each choice is a flag: ``--lambda-schedule code|paper``,
``--glance uniform|error|none`` (uniform over every k-th loss position as in the code, or among
mispredicted positions), ``--glance-loss keep|mask`` (the code keeps glanced positions in the
loss), ``--noise scaled|fixed`` (code: U(+-51.2/L), paper: U(+-0.1)).  ``--mode eagle`` trains an
EAGLE-1 drafter (k=1, fc fusion, no glancing) from the same data, and exports it in the layout of
vLLM's built-in ``method: "eagle"``.

Held-out metrics each epoch: per-block-position top-1 accuracy, and simulated tau of the default
tree (the longest tree path matching the target's greedy continuation, drafted exactly as in
serving from true features; see :mod:`falcon_vllm.tune_tree`).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from falcon_vllm.config import FalconConfig
from falcon_vllm.drafter import FalconDrafter, block_offsets, causal_context_mask, chunk_mask
from falcon_vllm.train.gen_data import Sample, layer_list, load_shards, stored_aux_layers
from falcon_vllm.tree import build_tree


# ---------------------------------------------------------------------- batches
def make_batch(samples: list[Sample], k: int, max_len: int, trim: list[int] | None = None):
    """Right-padded batch: tokens, features, loss positions, masks (samples all with or all without a teacher).

    ``trim[b]`` drops that many of sample b's last positions.  Blocks are aligned to the end, so a
    position's block level is fixed by its distance to the end: a random trim in [0, k) (the
    trainer's ``block_phase="random"``) gives every position every level across epochs, where a
    fixed end trains level 1 on the same half (k=2) of the positions every epoch; ``"both"`` puts
    each conversation into its batch k times, trimmed 0..k-1, so every position trains every level
    in every step (up to k times the compute of a step: 1.7x at k=2 in ``training_one_layer_smollm2``).

    Returns dict with ids_in [B,T] (x_{j+1}), feat_in [B,T,W] (f_j, then its aux states: W = H + aux width),
    feat_lbl [B,T,H] (f_{j+k}),
    lbl_ids [B,T] (x_{j+k+1}), loss [B,T] bool, attn [B,T,T] bool, lengths [B].
    """
    B = len(samples)
    lens = [min(len(s.tokens) - k - 1, max_len) for s in samples]
    if trim is not None:
        lens = [max(1, L - t) for L, t in zip(lens, trim)]
    T = max(lens)
    W, H = samples[0].features.shape[1], samples[0].hidden.shape[1]
    ids_in = torch.zeros(B, T, dtype=torch.long)
    lbl_ids = torch.zeros(B, T, dtype=torch.long)
    feat_in = torch.zeros(B, T, W)
    feat_lbl = torch.zeros(B, T, H)
    loss = torch.zeros(B, T, dtype=torch.bool)
    attn = torch.eye(T, dtype=torch.bool).expand(B, T, T).clone()  # padded rows see themselves
    teach = samples[0].teacher is not None
    if teach:  # cached teacher (see teacher_cache): gathered at the label feature f_{j+k}
        K = samples[0].teacher["idx"].shape[1]
        t = {"t_arg": torch.zeros(B, T, dtype=torch.long), "t_idx": torch.zeros(B, T, K, dtype=torch.long),
             "t_val": torch.zeros(B, T, K), "t_lse": torch.zeros(B, T), "t_lseT": torch.zeros(B, T)}
    for b, (s, L) in enumerate(zip(samples, lens)):
        tok, mask, hid = s.tokens, s.loss_mask, s.features
        ids_in[b, :L] = tok[1:L + 1]
        lbl_ids[b, :L] = tok[k + 1:L + k + 1]
        feat_in[b, :L] = hid[:L].float()
        feat_lbl[b, :L] = s.hidden[k:L + k].float()
        loss[b, :L] = mask[k + 1:L + k + 1]  # train where the predicted token is an answer token
        attn[b, :L, :L] = chunk_mask(0, L, k)
        if teach:
            c = s.teacher
            t["t_arg"][b, :L] = c["arg"][k:L + k]
            t["t_idx"][b, :L] = c["idx"][k:L + k].long()
            t["t_val"][b, :L] = c["val"][k:L + k].float()
            t["t_lse"][b, :L] = c["lse"][k:L + k]
            t["t_lseT"][b, :L] = c["lseT"][k:L + k]
            loss[b, :L] &= c["arg"][k:L + k] >= 0
    extra = t if teach else {}
    return {**extra, "ids_in": ids_in, "feat_in": feat_in, "feat_lbl": feat_lbl, "lbl_ids": lbl_ids, "loss": loss,
            "attn": attn, "lengths": torch.tensor(lens)}


def phase_batch(samples: list[Sample], cfg, rng: random.Random) -> tuple[list[Sample], list[int] | None]:
    """The conversations of one step and ``make_batch``'s ``trim`` for them under ``cfg.block_phase``: fixed
    (no trim), a random trim per conversation, or every conversation once per trim 0..k-1."""
    if cfg.k == 1 or cfg.block_phase == "fixed":
        return samples, None
    if cfg.block_phase == "random":
        return samples, [rng.randrange(cfg.k) for _ in samples]
    return [s for s in samples for _ in range(cfg.k)], list(range(cfg.k)) * len(samples)


@torch.inference_mode()
def teacher_cache(samples, lm_head, topk: int = 64, T: float = 0.95, chunk: int = 1024):
    # (runs where lm_head lives; the cache is kept on the CPU)
    """The frozen teacher over each answer-predicting feature, computed once instead of every step.

    For every feature f_i whose next token is an answer token (loss_mask[i+1]): argmax, the top-``topk``
    token ids and logits, logsumexp(t) and logsumexp(t/T).  Rows not computed have ``arg`` = -1.
    The soft loss then uses the teacher distribution truncated to its top-``topk`` (exact when
    ``topk`` = vocab; the mass outside the top-64 is small for a greedy self-distilled target).
    The rows of all conversations go through the head in chunks of exactly ``chunk`` rows: logits of
    one size, allocated again and again (with per-conversation sizes a 3,584-conversation cache grew past
    24 GB on CPU, most likely heap fragmentation; this way it stays near the size of its inputs).
    """
    topk = min(topk, lm_head.weight.shape[0])
    rows = [s.loss_mask[1:].bool().nonzero().flatten() for s in samples]  # feature i predicts token i+1
    feats = torch.cat([s.hidden[r] for s, r in zip(samples, rows)]) if samples else torch.zeros(0, 1)
    parts = {"arg": [], "idx": [], "val": [], "lse": [], "lseT": []}
    # minutes on a CPU for thousands of conversations: a bar over the chunks, quiet for small data
    from tqdm import tqdm

    for a in tqdm(range(0, feats.shape[0], chunk), desc="teacher cache", unit="chunk",
                  disable=feats.shape[0] < 64 * chunk):
        lg = lm_head(feats[a:a + chunk].to(lm_head.weight.device).float()).float()
        v, i = lg.topk(topk, dim=-1)
        for n, t in (("arg", i[:, 0]), ("idx", i.int()), ("val", v), ("lse", lg.logsumexp(-1)),
                     ("lseT", (lg / T).logsumexp(-1))):
            parts[n].append(t.cpu())
    flat = {n: torch.cat(p) if p else None for n, p in parts.items()}
    out, o = [], 0
    for s, r in zip(samples, rows):
        L, m = len(s.tokens), r.numel()
        c = {"arg": torch.full((L,), -1, dtype=torch.long), "idx": torch.zeros(L, topk, dtype=torch.int32),
             "val": torch.zeros(L, topk), "lse": torch.zeros(L), "lseT": torch.zeros(L)}
        for n in c:
            if m:
                c[n][r] = flat[n][o:o + m].to(c[n].dtype)
        out.append(c)
        o += m
    return out


def with_teacher(data_dir, data, lm_head, topk: int, log=print) -> list:
    """``data`` with each sample's cached teacher attached (``cached_teacher``)."""
    return [s._replace(teacher=c) for s, c in zip(data, cached_teacher(data_dir, data, lm_head, topk, log))]


def cached_teacher(data_dir, data, lm_head, topk: int, log=print):
    """teacher_cache(data), stored as ``teacher_top{topk}_n{len}.pt`` in ``data_dir`` (if given) and reused.

    Runs that start side by side on the same data build it once: the first holds a lock on
    ``<cache>.lock`` while it builds, and the others wait for it and load what it wrote."""
    if not data_dir:
        return teacher_cache(data, lm_head, topk)
    import fcntl
    import hashlib

    # next to the (first) data directory, named for the whole data set
    tag = hashlib.sha1(",".join(os.path.abspath(d) for d in data_dir.split(",") if d).encode()).hexdigest()[:8]
    cpath = os.path.join(data_dir.split(",")[0], f"teacher_top{topk}_n{len(data)}_{tag}.pt")
    if os.path.exists(cpath):  # written whole (a rename), so no lock to read it: a read-only data set loads too
        return torch.load(cpath, weights_only=False)
    with open(f"{cpath}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"teacher cache: waiting for another run building {os.path.basename(cpath)}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(cpath):
            return torch.load(cpath, weights_only=False)
        t0 = time.time()
        cache = teacher_cache(data, lm_head, topk)
        log(f"teacher cache: {len(data)} conversations in {time.time() - t0:.0f} s")
        tmp = f"{cpath}.{os.getpid()}.tmp"
        torch.save(cache, tmp)
        os.replace(tmp, cpath)
        return cache


def crop_context(sample: Sample, max_context: int) -> Sample:
    """Keep at most ``max_context`` tokens before the first answer token (rotary attention is relative,
    so a cropped prompt is a shorter prompt; it saves the drafter passes over long ShareGPT prompts)."""
    a = max(0, sample.answer_start() - max_context)
    if a == 0:
        return sample
    teacher = None if sample.teacher is None else {n: v[a:] for n, v in sample.teacher.items()}
    return sample._replace(tokens=sample.tokens[a:], loss_mask=sample.loss_mask[a:], features=sample.features[a:],
                           teacher=teacher)


def outside_of(samples, others) -> list:
    """``samples`` less those that begin with the prompt (tokens before the first answer token) of one of
    ``others``: the same question answered by the same greedy target is the same answer."""
    keys: dict[int, set] = {}
    for s in others:
        n = s.answer_start()
        keys.setdefault(n, set()).add(tuple(s.tokens[:n].tolist()))
    out = []
    for s in samples:
        t = s.tokens.tolist()
        if not any(len(t) >= n and tuple(t[:n]) in ks for n, ks in keys.items()):
            out.append(s)
    return out


def split_held_out(data: list) -> tuple[list, list, int]:
    """(training, held-out, left out): the last 1/16 of the conversations (at least one) are held out, less
    those whose prompt a training conversation also has (ShareGPT repeats questions: 67 of the last 579 of
    its 9,276 usable first turns, whose greedy answers the drafter would have trained on)."""
    n_val = max(1, len(data) // 16)
    train, tail = data[:-n_val], data[-n_val:]
    val = outside_of(tail, train)
    if tail and not val:
        raise ValueError("falcon-vllm: train: every held-out conversation repeats a training conversation's prompt")
    return train, val, len(tail) - len(val)


def frequent_tokens(samples, n: int, vocab: int) -> torch.Tensor:
    """The ``n`` most frequent answer tokens (loss-mask positions) of ``samples`` [n] (ties: lower id first)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.tokens[s.loss_mask.bool()].long(), minlength=vocab)
    return torch.sort(counts, descending=True, stable=True).indices[:n]


def vocab_coverage(samples, ids: torch.Tensor, vocab: int) -> float:
    """Share of answer tokens of ``samples`` that lie in ``ids``."""
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[ids] = True
    hit = total = 0
    for s in samples:
        t = s.tokens[s.loss_mask.bool()].long()
        hit += int(inside[t].sum())
        total += t.numel()
    return hit / max(1, total)


def epoch_batches(samples, batch_size: int, seed: int):
    """Length-bucketed batches (little padding) in a seeded random order."""
    rnd = random.Random(seed)
    order = list(range(len(samples)))
    rnd.shuffle(order)  # random tie-break and random composition across near-equal lengths
    order.sort(key=lambda i: len(samples[i].tokens) // 16)
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rnd.shuffle(batches)
    return batches


def lam(epoch: int, epochs: int, schedule: str) -> float:
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


INIT_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
               "head_dim", "num_layers", "k", "fusion", "fc_bias", "block_order", "draft_vocab_size", "aux_layers",
               "level_embedding")


def init_weights(drafter: FalconDrafter, directory: str, target_config) -> dict:
    """Load the weights of a trained drafter (Falcon format, or vLLM's EAGLE layout) into ``drafter``,
    whose architecture must be the same, head and ``d2t`` map included, except that ``drafter`` may have
    more decoder layers: the source's layers fill the first ones and each extra layer starts as the
    identity (its attention and MLP output projections zero), so the grown drafter first predicts exactly
    what the source did.  A k=1 source (an EAGLE-1 drafter) may also seed a drafter of any k and block order:
    no weight depends on either, and in the ``reversed`` order the block's last row, whose prediction is the
    next token, reads what EAGLE's single row reads.  Returns the provenance kept in the new drafter's
    training record: {"drafter": name, "training": the old drafter's own record[, "grown_layers": the new
    layers][, "k_from": 1]}."""
    src = FalconDrafter.load(directory, target_config)
    n_src, n_run = src.config.num_layers, drafter.config.num_layers
    seeds_k = src.config.k == 1 and drafter.config.k > 1
    free = {"num_layers"} if n_src < n_run else set()
    free |= {"k", "block_order"} if seeds_k else set()
    free |= {"level_embedding"} if not src.config.level_embedding else set()  # it starts at zero: the same drafter
    diff = [f"{n} {getattr(src.config, n)!r} (run: {getattr(drafter.config, n)!r})" for n in INIT_FIELDS
            if getattr(src.config, n) != getattr(drafter.config, n) and n not in free]
    if diff:
        raise ValueError(f"falcon-vllm: train: --init-from {directory} is another architecture than this run's "
                         "(only more decoder layers may differ, and k and the block order from a k=1 source): "
                         + ", ".join(diff))
    drafter.load_state_dict({**drafter.state_dict(), **src.state_dict()})
    with torch.no_grad():
        for layer in drafter.layers[n_src:]:  # residual branches that write nothing: the identity
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    record = {"drafter": os.path.basename(os.path.normpath(directory)), "training": src.config.extra.get("training")}
    if n_src < n_run:
        record["grown_layers"] = list(range(n_src, n_run))
    if seeds_k:
        record["k_from"] = 1
    return record


def to_device(batch: dict, device) -> dict:
    return {n: v.to(device, non_blocking=True) for n, v in batch.items()}


def init_distributed(device: str) -> tuple[int, int, str]:
    """(rank, world size, this rank's device): torchrun's environment -> a process group (NCCL on CUDA,
    gloo on CPU); a plain run is rank 0 of 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


# ---------------------------------------------------------------------- evaluation
@torch.inference_mode()
def evaluate(drafter, samples, tree, k: int, max_len: int, max_roots: int = 120, best_widths=(),
             context: str = "relaxed"):
    """Held-out per-block-position top-1 accuracy and simulated tau of ``tree``; with ``best_widths``,
    also the simulated tau of the best tree of each of those sizes, fitted to half of the roots and
    scored on the other half (``tune_tree.cross_fit_accepted``; rank profiles to depth 8, top-10 ranks).  Each
    sim tau comes with its standard error over the roots.  ``context`` "causal": the top-1 of each block as
    vLLM's proposer computes it (the positions before the block with causal K/V: ``causal_context_mask``);
    "relaxed": as training computes it (every block relaxed)."""
    if context not in ("relaxed", "causal"):
        raise ValueError(f"falcon-vllm: evaluate(context=) is 'relaxed' or 'causal', got {context!r}")
    from falcon_vllm.tune_tree import accepted_length, cross_fit_accepted, mean_tau, standard_error

    if not drafter.config.aux_layers:
        samples = [s.without_aux() for s in samples]
    check_aux(drafter.config.aux_layers, samples, drafter.config.hidden_size)
    drafter.eval()
    correct = torch.zeros(k)
    total = torch.zeros(k)
    dev = next(drafter.parameters()).device
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
    nodes = set(tree.nodes)
    profiles = root_profiles(drafter, samples, k, tree.max_depth, max(tree.topk, 1), max_roots, dev)
    accepted = [accepted_length(p, nodes) for p in profiles]
    out = {"top1_by_block_position": [round(x, 4) for x in (correct / total.clamp(min=1)).tolist()],
           "sim_tau": round(mean_tau(accepted), 4),
           "sim_tau_se": round(standard_error(accepted), 4), "sim_roots": len(accepted)}
    if best_widths:  # roots with room for depth 8 (the named tree's roots need room for its own depth)
        deep = root_profiles(drafter, samples, k, 8, 10, max_roots, dev)
        fits = {int(w): cross_fit_accepted(deep, int(w)) for w in best_widths}
        out["best_tree_sim_tau"] = {w: round(mean_tau(a), 4) for w, a in fits.items()}
        out["best_tree_sim_tau_se"] = {w: round(standard_error(a), 4) for w, a in fits.items()}
        out["best_tree_roots"] = len(deep)
    drafter.train()
    return out


def root_profiles(drafter, samples, k: int, depth: int, topk: int, max_roots: int, dev) -> list:
    """Rank profiles (``tune_tree.rank_profile``) at answer positions with ``depth`` tokens after them (every 3rd
    such position), at most ``max_roots`` in all, spread over the conversations: each conversation gives at
    most ceil(max_roots / conversations) of its positions, evenly spaced (roots of one conversation are
    correlated: the first ``max_roots`` in order would come from a handful of conversations)."""
    from falcon_vllm.tune_tree import rank_profile

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


# ---------------------------------------------------------------------- training loop
@dataclass
class TrainConfig:
    """Hyper-parameters and options of one training run (the ``falcon-vllm train`` flags).  Stored whole in
    ``checkpoint.pt`` and, without its paths, as the drafter's training record (``falcon.extra.training``)."""
    out_dir: str                          # drafter directory (checkpoint.pt each epoch: resumable)
    data_dir: str | None = None           # gen-data directory (comma-separated: several), unless train(samples=)
    extra_data_dir: str | None = None     # gen-data directories trained on, never held out (e.g. later turns)
    target_dir: str | None = None         # target HF dir, unless train(target=) gets the model
    mode: str = "falcon"                  # falcon (CSGD) | eagle (EAGLE-1: k=1, fc fusion, no glancing)
    k: int = 2                            # tokens per drafter block
    fusion: str = "lstm"                  # lstm | fc: fusion of token embedding and feature
    layers: int = 1                       # drafter decoder layers
    epochs: int = 3                       # passes over the training conversations
    batch_size: int = 8                   # conversations per step (per process)
    lr: float = 1e-3                      # AdamW peak learning rate (5% warm-up, then linear decay)
    max_len: int = 384                    # training positions per conversation
    glance: str = "uniform"               # uniform | error | none: which positions glancing replaces
    glance_loss: str = "keep"             # keep | mask: glanced positions in the loss
    lambda_schedule: str = "code"         # code | paper: glancing ratio over the epochs
    noise: str = "scaled"                 # scaled U(+-51.2/L) | fixed U(+-0.1): input feature noise
    w_dist: float = 0.1                   # weight of the token losses against the feature regression
    alpha: float = 0.9                    # soft-loss share of the token losses (the rest: CE)
    tree: str | None = None               # default tree, recorded in the drafter, for sim tau (None: by k)
    max_steps: int | None = None          # None: epochs x steps per epoch
    seed: int = 0                         # initial weights, batch order, noise and glancing
    eval_every_epoch: bool = True         # held-out metrics after each epoch (always at the end)
    resume: bool = True                   # continue from out_dir/checkpoint.pt if there is one
    save_dtype: str | None = None         # dtype of the stored weights: "bfloat16", "float32" (None: as trained)
    stop_after_epochs: int | None = None  # return after this many epochs (to resume later)
    bf16: bool = False                    # bf16 autocast
    teacher_topk: int = 64                # the frozen teacher's top-k cached once (0: full teacher every step)
    logit_positions: int | None = 256     # LM-head rows per batch for the token losses and glancing (None: all)
    max_context: int | None = 128         # prompt tokens kept before the answer (None: all)
    eval_roots: int = 240                 # held-out tree roots for the final simulated tau
    draft_vocab: int | None = None        # truncated draft head over the N most frequent answer tokens
    block_order: str = "forward"          # forward (the paper's) | reversed: level 1 from the block's last row
    level_embedding: bool = False         # a learned vector per block row added to the fused input
    block_phase: str = "fixed"            # fixed | random | both: trims of 0..k-1 last positions (make_batch)
    max_conversations: int | None = None  # train on the first N training conversations only
    device: str = "cpu"                   # cpu | cuda (under torchrun: each rank its LOCAL_RANK GPU)
    train_draft_head: bool = True         # train a truncated head (False: keep the target's rows)
    init_from: str | None = None          # start from this drafter's weights (same architecture and head)
    second_pass: float = 0.0              # weight of the loss on a second pass fed the first's predicted features
    aux_layers: tuple[int, ...] = ()      # also read these target layers' states (the data's gen-data --aux-layers)
    level_weights: tuple[float, ...] = () # loss weight per block level (k of them; level 1 first); () = all 1

    def record(self) -> dict:
        """The fields without the machine's paths (the training record ships with the drafter)."""
        return {n: v for n, v in asdict(self).items() if not n.endswith("_dir") and n != "init_from"}


def random_state(rng: random.Random, gen: torch.Generator) -> dict:
    """This process's random streams (kept with the checkpoint: a resumed run draws what it would have)."""
    return {"rng_py": rng.getstate(), "rng_gen": gen.get_state(), "rng_torch": torch.get_rng_state()}


def train_step(drafter, net, opt, sched, batch: dict, epoch: int, cfg: TrainConfig, rng: random.Random,
               gen: torch.Generator) -> dict:
    """One optimisation step on a device batch (``make_batch``): noise on the input features, the glance pass
    (no grad: the drafter's tokens against the teacher's), glancing, the gradient pass through ``net`` (the
    drafter or its DDP wrapper), the losses, the clipped AdamW and schedule step.
    Returns {"loss", "reg", "soft", "ce", "acc"} (floats)."""
    feats = add_noise(batch["feat_in"], batch["lengths"], cfg.noise, gen)
    ids = batch["ids_in"]
    loss_mask = batch["loss"]
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        if cfg.glance != "none":
            # token argmaxes on (a random subset of) the loss positions: the LM head dominates
            obs = subsample(loss_mask, cfg.logit_positions, gen)
            with torch.no_grad():
                pred0 = forward(drafter, ids, feats, batch)
                p_ids = torch.full_like(ids, -1)
                t_ids = torch.full_like(ids, -2)
                p_ids[obs] = drafter.topk_tokens(pred0[obs], 1)[:, 0]
                t_ids[obs] = (batch["t_arg"][obs] if "t_arg" in batch
                              else drafter.target_logits(batch["feat_lbl"][obs]).argmax(-1))
            pos = glance_positions(p_ids, t_ids, loss_mask, cfg.k, lam(epoch, cfg.epochs, cfg.lambda_schedule),
                                   cfg.glance, rng, observed=obs)
            ids, feats = apply_glance({**batch, "ids_in": ids, "feat_in": feats}, pos)
            if cfg.glance_loss == "mask":
                loss_mask = loss_mask.clone()
                for b, p in enumerate(pos):
                    loss_mask[b, p] = False
        pred, kv = forward(drafter, ids, feats, batch, net, with_kv=True)
        tok_mask = subsample(loss_mask, cfg.logit_positions, gen)
        lw = level_weights(batch, cfg.k, cfg.level_weights)
        loss, parts = losses(drafter, pred, batch, loss_mask, cfg.w_dist, cfg.alpha, token_mask=tok_mask, weights=lw)
        if cfg.second_pass:
            pred2, rows = second_pass(drafter, ids, pred, kv, batch, cfg.k, net)
            mask2 = batch["loss"] & rows
            loss2, parts2 = losses(drafter, pred2, batch, mask2, cfg.w_dist, cfg.alpha,
                                   token_mask=subsample(mask2, cfg.logit_positions, gen), weights=lw)
            loss = loss + cfg.second_pass * loss2
            parts["acc2"] = parts2["acc"]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_value_(drafter.parameters(), 0.5)
    opt.step()
    sched.step()
    return {"loss": float(loss.detach()), **parts}


def train(cfg: TrainConfig, samples: list[Sample] | None = None, target=None, log=print) -> dict:
    """Train a drafter into ``cfg.out_dir`` (``checkpoint.pt`` each epoch: resumable) on the conversations of
    ``cfg.data_dir``, or on ``samples`` (then no teacher cache is written), distilled from ``target`` (default:
    loaded from ``cfg.target_dir``).  Under ``torchrun`` it runs data-parallel (DDP; NCCL on CUDA, gloo on
    CPU): each rank takes every world-th batch, rank 0 evaluates and writes.  Returns {"final", "history",
    "out", "drafter"} (rank 0; others: "final" None).

    The drafter's attention runs without cuDNN's SDPA kernel, which builds an execution plan for every new
    batch shape: training batches come in as many shapes as there are conversation lengths (H100, bf16:
    0.150 s per step with it, 0.036 s without; ``benchmarks/results/gpu/train_speed_h100_cuda_*.md``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return _train(cfg, samples, target, log)


def _train(cfg: TrainConfig, samples: list[Sample] | None, target, log) -> dict:
    from tqdm import tqdm

    if cfg.block_phase not in ("fixed", "random", "both"):
        raise ValueError("falcon-vllm: train: block_phase must be 'fixed', 'random' or 'both', not "
                         f"{cfg.block_phase!r}")
    if not cfg.w_dist >= 0:
        raise ValueError(f"falcon-vllm: train: the token-loss weight must be >= 0, not {cfg.w_dist!r}")
    if cfg.level_weights and (len(cfg.level_weights) != cfg.k or min(cfg.level_weights) < 0
                              or max(cfg.level_weights) <= 0):
        raise ValueError(f"falcon-vllm: train: --level-weights takes k = {cfg.k} weights >= 0, not all 0 (level 1 "
                         f"first), got {list(cfg.level_weights)}")
    if cfg.second_pass < 0:
        raise ValueError(f"falcon-vllm: train: the second-pass loss weight must be >= 0, not {cfg.second_pass!r}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("falcon-vllm: train: --device cuda but torch sees no CUDA device")
    rank, world, device = init_distributed(cfg.device)
    if cfg.second_pass and world > 1:
        raise ValueError("falcon-vllm: train: --second-pass runs in one process only (not yet under torchrun)")
    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    rng = random.Random(cfg.seed + rank)
    gen = torch.Generator().manual_seed(cfg.seed + rank)
    if target is None:
        from transformers import AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained(cfg.target_dir, dtype=torch.float32).eval()
    target = target.to(device)
    if cfg.mode == "eagle":  # EAGLE-1: one token per block, fc fusion, no glancing
        cfg = replace(cfg, k=1, fusion="fc", glance="none")
    if cfg.tree is None:
        cfg = replace(cfg, tree={2: "falcon-llama", 1: "eagle-small"}.get(cfg.k, f"chain-{2 * cfg.k}"))
    data = load_shards(cfg.data_dir, aux=bool(cfg.aux_layers)) if samples is None else samples
    if not cfg.aux_layers:  # a drafter without aux layers reads the final-norm states alone
        data = [s.without_aux() for s in data]
    check_aux(cfg.aux_layers, data, target.config.hidden_size, cfg.data_dir if samples is None else None)
    if cfg.teacher_topk:  # the frozen teacher once, not every step (cached next to the data when on disk)
        data = with_teacher(cfg.data_dir if samples is None else None, data, target.get_output_embeddings(),
                            cfg.teacher_topk, log)
    train_set, val_set, val_left_out = split_held_out(data)  # before cropping: whole prompts compared
    log(f"held out: {len(val_set)} conversations ({val_left_out} more left out: a training conversation has "
        "their prompt)")
    extra, left_out = [], 0
    if cfg.extra_data_dir:  # training-only conversations, minus any that begin like a held-out one
        extra = load_shards(cfg.extra_data_dir, aux=bool(cfg.aux_layers))
        check_aux(cfg.aux_layers, extra, target.config.hidden_size, cfg.extra_data_dir)
        if cfg.teacher_topk:
            extra = with_teacher(cfg.extra_data_dir, extra, target.get_output_embeddings(), cfg.teacher_topk, log)
        kept = outside_of(extra, val_set)
        left_out = len(extra) - len(kept)
        extra = [s for s in kept if s.loss_mask.any()]
        log(f"extra training data: {len(extra)} conversations with answer tokens, "
            f"{sum(int(s.loss_mask.sum()) for s in extra)} answer tokens; {left_out} left out as they begin "
            "like a held-out conversation")
    if cfg.max_context is not None:
        train_set, val_set, extra = ([crop_context(s, cfg.max_context) for s in part]
                                     for part in (train_set, val_set, extra))
    if cfg.max_conversations:  # data-size ablations: fewer training conversations, the same held-out ones
        train_set = train_set[:cfg.max_conversations]
    train_set = train_set + extra
    dcfg = FalconConfig.from_target(target.config, k=cfg.k, fusion=cfg.fusion, num_layers=cfg.layers, tree=cfg.tree,
                                    draft_vocab_size=cfg.draft_vocab, block_order=cfg.block_order,
                                    level_embedding=cfg.level_embedding, aux_layers=tuple(cfg.aux_layers))
    drafter = FalconDrafter(dcfg).to(device)
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    init_record = None
    if cfg.init_from:  # continue a trained drafter (its head and d2t map included) with a fresh schedule
        init_record = init_weights(drafter, cfg.init_from, target.config)
    elif dcfg.draft_vocab_size:  # truncated head: the most frequent answer tokens, from the target's rows
        drafter.init_draft_head(frequent_tokens(train_set, dcfg.draft_vocab_size, dcfg.vocab_size),
                                target.get_output_embeddings().weight)
    for p in target.parameters():
        p.requires_grad_(False)
    if dcfg.draft_vocab_size and not cfg.train_draft_head:  # keep the target's rows
        drafter.lm_head.weight.requires_grad_(False)
    net = drafter
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(drafter, device_ids=[torch.device(device).index] if device.startswith("cuda")
                                      else None)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.01)
    steps_per_epoch = max(1, math.ceil(len(train_set) / cfg.batch_size) // world)
    total = cfg.max_steps or steps_per_epoch * cfg.epochs
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * max(0.0, 1 - s / total))
    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt = os.path.join(cfg.out_dir, "checkpoint.pt")
    rng_file = os.path.join(cfg.out_dir, f"rng_rank{rank}.pt")  # each rank's random streams
    state = {"step": 0, "epoch": 0, "history": []}
    if cfg.resume and os.path.exists(ckpt):
        c = torch.load(ckpt, weights_only=False, map_location=device)
        drafter.load_state_dict(c["model"])
        opt.load_state_dict(c["opt"])
        sched.load_state_dict(c["sched"])
        state = c["state"]
        if c.get("world", 1) != world:
            raise ValueError(f"falcon-vllm: train: {ckpt} was written by {c.get('world', 1)} processes; resume it "
                             f"with as many (this run has {world})")
        r = torch.load(rng_file, weights_only=False) if os.path.exists(rng_file) else c
        rng.setstate(r["rng_py"])
        gen.set_state(r["rng_gen"])
        torch.set_rng_state(r["rng_torch"])
        log(f"resumed at step {state['step']}")
    tree_obj = build_tree(cfg.tree, cfg.k)
    t0 = time.time()
    drafter.train()
    bar = tqdm(total=total, initial=state["step"], desc=f"train {cfg.mode}", unit="step", disable=rank > 0)
    while state["step"] < total:
        if cfg.stop_after_epochs is not None and state["epoch"] >= cfg.stop_after_epochs:
            bar.close()
            return {"stopped": True, "state": state, "out": cfg.out_dir}  # resume later from checkpoint.pt
        epoch = state["epoch"]
        batches = epoch_batches(train_set, cfg.batch_size, cfg.seed + epoch)[rank::world][:steps_per_epoch]
        for bi in range(state["step"] % steps_per_epoch, len(batches)):
            if state["step"] >= total:
                break
            step_samples, trim = phase_batch([train_set[j] for j in batches[bi]], cfg, rng)
            batch = to_device(make_batch(step_samples, cfg.k, cfg.max_len, trim), device)
            out = train_step(drafter, net, opt, sched, batch, epoch, cfg, rng, gen)
            state["step"] += 1
            bar.update(1)
            bar.set_postfix(loss=f"{out['loss']:.3f}", acc=f"{out['acc']:.2f}")
        else:
            state["epoch"] += 1
            if rank == 0:
                if cfg.eval_every_epoch:
                    ev = evaluate(drafter, val_set, tree_obj, cfg.k, cfg.max_len, max(12, cfg.eval_roots // 5))
                    ev.update(epoch=state["epoch"], step=state["step"], seconds=round(time.time() - t0, 1))
                    state["history"].append(ev)
                    log(f"epoch {state['epoch']}: {json.dumps(ev)}")
                torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "state": state, "world": world, "config": asdict(cfg), **random_state(rng, gen)},
                           ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            if world > 1:
                torch.save(random_state(rng, gen), rng_file)
                torch.distributed.barrier()
    bar.close()
    if rank > 0:
        torch.distributed.barrier()  # rank 0 evaluates and writes the drafter
        return {"final": None, "history": state["history"], "out": cfg.out_dir, "drafter": drafter}
    final = evaluate(drafter, val_set, tree_obj, cfg.k, cfg.max_len, cfg.eval_roots)
    final.update(steps=state["step"], seconds=round(time.time() - t0, 1), train_conversations=len(train_set),
                 extra_conversations=len(extra), extra_left_out=left_out,
                 heldout_conversations=len(val_set), heldout_left_out=val_left_out, processes=world,
                 device=str(torch.device(device).type))
    # the training record (draft_vocab as the drafter has it: None when it is the whole vocabulary)
    dcfg.extra = {"training": {**cfg.record(), "draft_vocab": dcfg.draft_vocab_size, "steps": state["step"],
                               "heldout": final}}
    if init_record is not None:  # the run it continued (its own record, chained)
        dcfg.extra["training"]["init_from"] = init_record
    drafter.eval()
    save_dtype = getattr(torch, cfg.save_dtype) if cfg.save_dtype else None
    drafter.save_pretrained(cfg.out_dir, dtype=save_dtype)
    if cfg.mode == "eagle":
        export_vllm_eagle(drafter, os.path.join(cfg.out_dir, "vllm-eagle"), dtype=save_dtype)
    if world > 1:
        torch.distributed.barrier()
    return {"final": final, "history": state["history"], "out": cfg.out_dir, "drafter": drafter}


def check_aux(aux_layers, data: list, hidden: int, data_dir: str | None = None) -> None:
    """``data`` (read from ``data_dir``, if given) must carry exactly the states entering ``aux_layers`` (none when
    there are none): a drafter reading other layers, or none, would be trained or scored on the wrong input."""
    if aux_layers and data_dir:
        have = stored_aux_layers(data_dir)
        if any(h != list(aux_layers) for h in have):
            raise ValueError(f"falcon-vllm: train: --aux-layers {list(aux_layers)}, but {data_dir} has "
                             f"{have[0] if len(have) == 1 else have}; make the data with "
                             f"`falcon-vllm gen-data --aux-layers {','.join(map(str, aux_layers))}`")
    width = len(aux_layers) * hidden
    bad = sum(1 for s in data if s.aux_width != width)
    if bad:
        raise ValueError(f"falcon-vllm: {bad} conversations do not carry the {len(aux_layers)} aux states "
                         f"--aux-layers {list(aux_layers)} asks for (gen-data --aux-layers, or "
                         "gen_data.with_aux_states for data made without them)")


def export_vllm_eagle(drafter: FalconDrafter, out: str, dtype: torch.dtype | None = None) -> None:
    """Export a k=1 fc drafter in the layout of vLLM's built-in EAGLE-1 (EagleLlamaForCausalLM)."""
    from safetensors.torch import save_file

    cfg = drafter.config
    if cfg.k != 1 or cfg.fusion != "fc" or cfg.fc_bias:
        raise ValueError("falcon-vllm: only k=1 fc drafters without fc bias have vLLM's EAGLE layout")
    d = cfg.to_hf_dict()
    d.pop("falcon")
    # a truncated head needs the plugin's EAGLE-1 class (vLLM's own reads no d2t map)
    d["architectures"] = ["EagleD2TLlamaForCausalLM" if cfg.draft_vocab_size else "LlamaForCausalLM"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    save_file({n: t.detach().to(dtype if dtype and t.is_floating_point() else t.dtype).contiguous()
               for n, t in drafter.state_dict().items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


RECIPES = {
    # SmolLM2-135M-Instruct on a 2-core CPU: gen-data through vLLM (8192 ShareGPT first turns x up to 160
    # greedy tokens; featurized from the stored answers in about an hour, about 30 min per 2048 conversations
    # when generated), then the Falcon drafter (k=2, fc fusion, CSGD, 2 decoder layers, reversed block order)
    # and the EAGLE-1 baseline (1 layer) in the same stages, on the same data with the same truncated head.
    # Held out: the last 1/16 of the data (conversations 7680-8191).
    "smollm2": {"num_conversations": 8192, "max_new_tokens": 160, "shard_size": 128, "backend": "vllm",
                "epochs": 5, "batch_size": 8, "lr": 2e-3, "fusion": "fc", "k": 2, "tree": "falcon-llama",
                "falcon_layers": 2, "falcon_block_order": "reversed", "draft_vocab": 8192,
                "falcon_dir": "smollm2-135m-instruct", "eagle_dir": "smollm2-135m-instruct-eagle",
                "eagle_tree": "eagle-small",
                "answers": "smollm2-sharegpt.safetensors",
                # stage 1: the first 3,360 conversations, 5 epochs (the draft head's tokens come from them)
                "max_conversations": 3360,
                # each later stage: a new schedule from the weights before; stage 2: the same conversations,
                # 4 epochs, lr 1e-3; stage 3: the first 5,280, 2 epochs; stage 4: all 7,680, 3 epochs; stage 5:
                # all 7,680 again, 2 epochs at lr 3e-4 (a restart at 1e-3 first costs accuracy)
                "continue": [{"epochs": 4, "lr": 1e-3}, {"epochs": 2, "lr": 1e-3, "max_conversations": 5280},
                             {"epochs": 3, "lr": 1e-3, "max_conversations": None},
                             {"epochs": 2, "lr": 3e-4, "max_conversations": None}]},
}


def install_drafter(src: str, dst: str, files=("config.json", "model.safetensors")) -> None:
    import shutil

    os.makedirs(dst, exist_ok=True)
    for f in files:
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    tgt = cfg.get("falcon", {}).get("target", {})
    if "name" in tgt:  # record the target's name, not where it lay on the training machine
        tgt["name"] = os.path.basename(str(tgt["name"]).rstrip("/"))
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


# the flags a recipe run takes from the command line for its Falcon stages (a variant of the recipe to compare)
RECIPE_FALCON_FLAGS = ("glance", "block_phase")


def run_recipe(name: str, work: str, install: bool = True, device: str = "cpu", log=print,
               falcon_overrides: dict | None = None) -> dict:
    """gen-data + Falcon (CSGD) + EAGLE baseline for a known target; installs into falcon_vllm/drafters.
    Every step resumes where it stopped (gen-data by shard, training by epoch).  ``falcon_overrides``: TrainConfig
    fields (``RECIPE_FALCON_FLAGS``) that every Falcon stage takes instead of the recipe's."""
    import importlib.util

    from falcon_vllm.models import model_path
    from falcon_vllm.train import gen_data

    r = RECIPES[name]
    falcon_overrides = dict(falcon_overrides or {})
    if unknown := sorted(set(falcon_overrides) - set(RECIPE_FALCON_FLAGS)):
        raise ValueError(f"falcon-vllm: train --recipe: only {', '.join(RECIPE_FALCON_FLAGS)} can be changed for the "
                         f"Falcon stages, not {unknown}")
    target_dir = str(model_path())
    data = os.path.join(work, "data")
    backend = r["backend"]
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        log("vLLM is not installed here: gen-data answers with transformers' generate (slower, same data)")
        backend = "hf"
    # the recipe's conversations as generated before (tokens only, in the source tree): featurized, not generated
    answers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "answers", r["answers"])
    t0 = time.time()
    gen_data.run(target_dir, data, r["num_conversations"], r["max_new_tokens"], shard_size=r["shard_size"],
                 backend=backend, answers=answers if os.path.exists(answers) else None)
    t_data = time.time() - t0
    common = dict(data_dir=data, target_dir=target_dir, epochs=r["epochs"], batch_size=r["batch_size"], lr=r["lr"],
                  draft_vocab=r["draft_vocab"], save_dtype="bfloat16", device=device,
                  max_conversations=r.get("max_conversations"))

    def staged(out: str, **kw) -> dict:  # each later stage continues the one before (new optimiser and schedule)
        res, prev = None, None
        for i, stage in enumerate([{}] + r.get("continue", [])):
            d = out if i == 0 else f"{out}-stage{i + 1}"
            res = train(TrainConfig(d, **{**kw, **stage, "init_from": prev}), log=log)
            prev = d
        return res

    fal = staged(os.path.join(work, "falcon"), k=r["k"], fusion=r["fusion"], tree=r["tree"],
                 layers=r.get("falcon_layers", 1), block_order=r.get("falcon_block_order", "forward"),
                 **{**common, "epochs": r.get("falcon_epochs", r["epochs"])}, **falcon_overrides)
    eag = staged(os.path.join(work, "eagle"), mode="eagle", tree=r["eagle_tree"], **common)
    # the target's answers the drafter trained on, for serving's retrieval drafts (falcon_vllm.datastore)
    if not os.path.exists(answers):
        answers = os.path.join(work, "answers.safetensors")
        gen_data.save_answers(data, answers)
    from falcon_vllm.datastore import from_answers_file

    os.makedirs(fal["out"], exist_ok=True)
    from_answers_file(answers, r["num_conversations"])[0].save(os.path.join(fal["out"], "datastore.npz"))
    out = {"recipe": name, "device": device, "gen_data_seconds": round(t_data, 1), "falcon": fal["final"],
           "eagle": eag["final"], "falcon_overrides": falcon_overrides,
           "total_seconds": round(time.time() - t0, 1)}
    if install:
        shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafters")
        install_drafter(fal["out"], os.path.join(shipped, r["falcon_dir"]),
                        files=("config.json", "model.safetensors", "datastore.npz"))
        install_drafter(os.path.join(eag["out"], "vllm-eagle"), os.path.join(shipped, r["eagle_dir"]))
        out["installed"] = [r["falcon_dir"], r["eagle_dir"]]
    with open(os.path.join(work, "recipe_log.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def add_arguments(p):
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="run a whole known recipe (gen-data, Falcon drafter, EAGLE baseline) into --work and "
                        "install the drafters into falcon_vllm/drafters/; resumable")
    p.add_argument("--work", default=".cache/drafter-run", help="working directory of --recipe")
    p.add_argument("--no-install", action="store_true",
                   help="with --recipe: leave the trained drafters in --work instead of installing them into "
                        "falcon_vllm/drafters/ (e.g. a variant of the recipe: --recipe smollm2 --glance none)")
    p.add_argument("--data", default=None, help="gen-data output directory")
    p.add_argument("--out", default=None, help="output drafter directory (checkpoint.pt for resume)")
    p.add_argument("--target", default=None, help="target HF dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--mode", choices=["falcon", "eagle"], default="falcon")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--fusion", choices=["lstm", "fc"], default="lstm")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--glance", choices=["uniform", "error", "none"], default="uniform")
    p.add_argument("--glance-loss", choices=["keep", "mask"], default="keep")
    p.add_argument("--lambda-schedule", choices=["code", "paper"], default="code")
    p.add_argument("--noise", choices=["scaled", "fixed"], default="scaled")
    p.add_argument("--tree", default=None, help="default tree recorded in the drafter and used for sim tau")
    p.add_argument("--teacher-topk", type=int, default=64,
                   help="cache the frozen teacher's top-k once (soft loss over it); 0 = full teacher every step")
    p.add_argument("--logit-positions", type=int, default=256,
                   help="LM-head rows per batch for the token losses and the glance pass (random subset of the "
                        "loss positions; 0 = all)")
    p.add_argument("--max-context", type=int, default=128,
                   help="prompt tokens kept before the answer (0 = all)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="truncated draft head over the N most frequent answer tokens (stored with its d2t map); "
                        "default: the target's full LM head")
    p.add_argument("--freeze-draft-head", action="store_true",
                   help="keep a truncated head at the target's LM-head rows (default: trained with the drafter)")
    p.add_argument("--block-order", choices=["forward", "reversed"], default="forward",
                   help="which block row outputs the next token: forward = the block's first (the paper's), "
                        "reversed = its last, whose input is the newest")
    p.add_argument("--level-embedding", action="store_true",
                   help="a learned vector per block row (its offset inside the k-block) added to the fused input")
    p.add_argument("--token-weight", type=float, default=0.1,
                   help="weight of the token losses (soft + CE) against the feature regression (the paper's 0.1)")
    p.add_argument("--level-weights", default="",
                   help="comma-separated loss weight of each block level, level 1 (the next token) first, k of them "
                        "(e.g. 1,0.5); default: all 1")
    p.add_argument("--second-pass", type=float, default=0.0,
                   help="weight of a second loss on the drafter's next pass, fed the features its first pass "
                        "predicted (as tree passes are in serving; EAGLE-3's training-time test); 0 = off")
    p.add_argument("--aux-layers", default="",
                   help="comma-separated target layers whose input states the drafter also reads (EAGLE-3's "
                        "low/mid/high features); the data must have been made with the same gen-data --aux-layers")
    p.add_argument("--block-phase", choices=["fixed", "random", "both"], default="fixed",
                   help="random: each step trims 0..k-1 of a conversation's last positions, so every position "
                        "trains every block level across epochs; both: every conversation k times per step, "
                        "once per trim, so every position trains every level in every step (up to k times the "
                        "compute); fixed: the same level each epoch")
    p.add_argument("--extra-data", default=None,
                   help="gen-data directories (comma-separated) trained on after --data's training conversations and "
                        "never held out, e.g. the later turns of those conversations (gen-data --loss-from-turn 2); "
                        "any that begins with a held-out conversation's prompt is left out")
    p.add_argument("--max-conversations", type=int, default=None,
                   help="train on the first N training conversations only (the held-out set is unchanged)")
    p.add_argument("--init-from", default=None,
                   help="start from this trained drafter's weights (same architecture and draft head; a new "
                        "optimiser and schedule: e.g. to train a shipped drafter further). With more --layers than "
                        "it has, the extra layers start as the identity (zero output projections); an EAGLE-1 "
                        "drafter (k=1) may seed a Falcon drafter of any --k and --block-order")
    p.add_argument("--eval-roots", type=int, default=240, help="held-out tree roots for the final simulated tau")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: each rank its LOCAL_RANK GPU)")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 autocast (off by default: on a 2-core AVX-512 CPU one step measured 26x slower "
                        "than fp32, 242 s vs 9.3 s at batch 8)")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="dtype of the stored weights (bf16 keeps a 1-layer drafter small enough for git)")


def recipe_overrides(args) -> dict:
    """The Falcon-stage flags (RECIPE_FALCON_FLAGS) given with --recipe; any other training flag given there would
    be ignored by the recipe's own settings, so it is refused.  ``args.given``: the options given (``falcon-vllm
    train`` sets it: falcon_vllm.cli.given_options); without it, those whose value differs from the default."""
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    defaults = vars(p.parse_args([]))
    kept = ("work", "device", "threads", "no_install")  # what --recipe itself takes (besides RECIPE_FALCON_FLAGS)
    given = getattr(args, "given", None)
    given = {k: v for k, v in vars(args).items() if k in defaults and k not in kept and k != "recipe"
             and (k in given if given is not None else v != defaults[k])}
    ignored = sorted(k for k in given if k not in RECIPE_FALCON_FLAGS)
    if ignored:
        def flags(names):
            return ", ".join("--" + n.replace("_", "-") for n in names)

        raise SystemExit(f"falcon-vllm: train: --recipe runs the recipe's own settings; it takes {flags(kept)} and, "
                         f"for its Falcon stages, {flags(RECIPE_FALCON_FLAGS)}; given too: {flags(ignored)}")
    return {k: v for k, v in given.items() if k in RECIPE_FALCON_FLAGS}


def main(args):
    from falcon_vllm.models import model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.recipe:
        print(json.dumps(run_recipe(args.recipe, args.work, install=not args.no_install, device=args.device,
                                    falcon_overrides=recipe_overrides(args)), indent=1))
        return 0
    if args.no_install:
        raise SystemExit("falcon-vllm: train: --no-install applies to --recipe only")
    if not args.data or not args.out:
        raise SystemExit("falcon-vllm: train: --data and --out are required (or --recipe)")
    cfg = TrainConfig(args.out, data_dir=args.data, extra_data_dir=args.extra_data,
                      target_dir=args.target or str(model_path()), mode=args.mode,
                      k=args.k, fusion=args.fusion, layers=args.layers, epochs=args.epochs, batch_size=args.batch_size,
                      lr=args.lr, max_len=args.max_len, glance=args.glance, glance_loss=args.glance_loss,
                      lambda_schedule=args.lambda_schedule, noise=args.noise, tree=args.tree, max_steps=args.max_steps,
                      save_dtype=args.save_dtype, bf16=args.bf16, teacher_topk=args.teacher_topk,
                      logit_positions=args.logit_positions or None, max_context=args.max_context or None,
                      eval_roots=args.eval_roots, draft_vocab=args.draft_vocab,
                      max_conversations=args.max_conversations, device=args.device,
                      train_draft_head=not args.freeze_draft_head, block_order=args.block_order,
                      level_embedding=args.level_embedding,
                      block_phase=args.block_phase, init_from=args.init_from, w_dist=args.token_weight,
                      aux_layers=layer_list(args.aux_layers), second_pass=args.second_pass,
                      level_weights=tuple(float(x) for x in args.level_weights.split(",") if x.strip()))
    res = train(cfg)
    if res["final"] is None:  # not rank 0
        return 0
    with open(os.path.join(args.out, "training_log.json"), "w") as f:
        json.dump({n: v for n, v in res.items() if n != "drafter"}, f, indent=1)
    print(json.dumps(res["final"]))
    return 0
