"""The conversations a drafter trains on: the frozen teacher cached over them, the held-out split, and the
batches of a training step.

A conversation is a :class:`falcon_vllm.train.gen_data.Sample` (what ``falcon-vllm gen-data`` stores, read by
``load_shards``).  ``make_batch`` lays a list of them out as one right-padded batch with the drafter's relaxed
mask; the held-out set is the last 1/16 of the data less the prompts a training conversation repeats
(``split_held_out``, also what ``falcon-vllm tune-tree --data`` profiles on).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import time

import torch

from falcon_vllm.drafter import chunk_mask
from falcon_vllm.train.gen_data import Sample, stored_aux_layers


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


def epoch_batches(samples, batch_size: int, seed: int):
    """Length-bucketed batches (little padding) in a seeded random order."""
    rnd = random.Random(seed)
    order = list(range(len(samples)))
    rnd.shuffle(order)  # random tie-break and random composition across near-equal lengths
    order.sort(key=lambda i: len(samples[i].tokens) // 16)
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rnd.shuffle(batches)
    return batches


def to_device(batch: dict, device) -> dict:
    return {n: v.to(device, non_blocking=True) for n, v in batch.items()}


@torch.inference_mode()
def teacher_cache(samples, lm_head, topk: int = 64, T: float = 0.95, chunk: int = 1024, bf16: bool = False,
                  margin: int = 16):
    # (runs where lm_head lives; the cache is kept on the CPU)
    """The frozen teacher over each answer-predicting feature, computed once instead of every step.

    For every feature f_i whose next token is an answer token (loss_mask[i+1]): argmax, the top-``topk``
    token ids and logits, logsumexp(t) and logsumexp(t/T).  Rows not computed have ``arg`` = -1.
    The soft loss then uses the teacher distribution truncated to its top-``topk`` (exact when
    ``topk`` = vocab; the mass outside the top-64 is small for a greedy self-distilled target).
    The rows of all conversations go through the head in chunks of at most ``chunk`` rows, into two
    buffers of logits allocated once (with per-conversation sizes a 3,584-conversation cache grew past
    24 GB on CPU, most likely heap fragmentation; this way it stays near the size of its inputs, and a
    chunk allocates nothing large: on a 152k vocabulary the fresh allocations cost a quarter of the time).

    ``bf16``: the head's product over the whole vocabulary in bf16 (where the device computes bf16 natively,
    2.4x fp32's on an AVX512-BF16 CPU), then the top ``topk + margin`` candidates' logits recomputed in fp32: the
    argmax, the top-``topk`` ids and logits are fp32's (unless a true top-``topk`` token ranks below ``topk +
    margin`` in bf16), and the log-sum-exps take the candidates' fp32 terms and the rest of the vocabulary's bf16
    ones (``teacher_cache_bf16_qwen15``).
    """
    w, bias = lm_head.weight, lm_head.bias
    wl = w.bfloat16() if bf16 and w.dtype != torch.bfloat16 else w   # (one copy, for the whole cache)
    topk = min(topk, w.shape[0])
    cand = min(topk + margin, w.shape[0]) if bf16 else topk
    rows = [s.loss_mask[1:].bool().nonzero().flatten() for s in samples]  # feature i predicts token i+1
    feats = torch.cat([s.hidden[r] for s, r in zip(samples, rows)]) if samples else torch.zeros(0, 1)
    parts = {"arg": [], "idx": [], "val": [], "lse": [], "lseT": []}
    n = feats.shape[0]
    logits = torch.empty(min(chunk, n), w.shape[0], device=w.device, dtype=wl.dtype)
    shifted = torch.empty(logits.shape, device=w.device, dtype=torch.float32)
    for a in range(0, n, chunk):
        x = feats[a:a + chunk].to(w.device, w.dtype)
        lg, d = logits[:len(x)], shifted[:len(x)]
        if bias is None:
            torch.mm(x.to(wl.dtype), wl.t(), out=lg)
        else:
            torch.addmm(bias.to(wl.dtype), x.to(wl.dtype), wl.t(), out=lg)
        v0, i = lg.topk(cand, dim=-1)
        shift = v0[:, :1].float()                          # the row maximum: t - shift <= 0 (in bf16: nearly)
        v0 = v0.float()
        v = exact_logits(x, w, bias, i) if bf16 else v0
        sums = []
        for scale in (1.0, 1 / T):
            total = d.copy_(lg).sub_(shift).mul_(scale).exp_().sum(-1)   # (a bf16 - fp32 sub: 10x slower)
            if bf16:   # the candidates' terms at fp32's logits
                total = (total - ((v0 - shift) * scale).exp().sum(-1)).clamp_(min=0) \
                    + ((v - shift) * scale).exp().sum(-1)
            sums.append(total)
        lse, lseT = shift[:, 0] + sums[0].log(), shift[:, 0] / T + sums[1].log()
        if bf16:
            v, order = v.sort(dim=-1, descending=True)
            v, i = v[:, :topk], i.gather(1, order[:, :topk])
        for name, t in (("arg", i[:, 0]), ("idx", i.int()), ("val", v), ("lse", lse), ("lseT", lseT)):
            parts[name].append(t.cpu())
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


def exact_logits(x, w, bias, ids, rows: int = 128):
    """The head's logits of the tokens ``ids`` (n, c) for the features ``x`` (n, d), in ``w``'s dtype."""
    out = torch.empty(ids.shape, device=w.device, dtype=torch.float32)
    for a in range(0, len(x), rows):   # (a block of rows at a time: their weight rows are gathered)
        sel = ids[a:a + rows]
        out[a:a + rows] = torch.bmm(w[sel], x[a:a + rows, :, None].to(w.dtype))[..., 0].float()
        if bias is not None:
            out[a:a + rows] += bias[sel].float()
    return out


# the files cached_teacher writes: teacher_top{topk}_n{conversations}[_partial]_{tag of the data directories}.pt
TEACHER_CACHE = re.compile(r"teacher_top\d+_n(\d+)(_partial)?_[0-9a-f]+\.pt$")


def with_teacher(data_dir, data, lm_head, topk: int, log=print, bf16: bool = False) -> list:
    """``data`` with each sample's cached teacher attached (``cached_teacher``)."""
    cache = cached_teacher(data_dir, data, lm_head, topk, log, bf16=bf16)
    return [s._replace(teacher=c) for s, c in zip(data, cache)]


def cached_teacher(data_dir, data, lm_head, topk: int, log=print, block: int = 512, save_minutes: float = 10.0,
                   bf16: bool = False):
    """teacher_cache(data), stored as ``teacher_top{topk}_n{len}.pt`` in ``data_dir`` (if given) and reused.

    Runs that start side by side on the same data build it once: the first holds a lock on
    ``<cache>.lock`` while it builds, and the others wait for it and load what it wrote. A data set that
    gen-data has grown since (shards are only appended) reuses the cache of its first conversations and
    computes the new ones' alone.  The build (on 2 CPU cores about 55 min for a million answer tokens of a
    150k-token vocabulary in fp32, 33 with ``bf16``) goes ``block`` conversations at a time and writes the cache so
    far every ``save_minutes``, as the cache of the first conversations: an interrupted build resumes there."""
    if not data_dir:
        return teacher_cache(data, lm_head, topk, bf16=bf16)
    import fcntl
    import hashlib

    # next to the (first) data directory, named for the whole data set
    tag = hashlib.sha1(",".join(os.path.abspath(d) for d in data_dir.split(",") if d).encode()).hexdigest()[:8]
    where, head, tail = data_dir.split(",")[0], f"teacher_top{topk}_n", f"_{tag}.pt"  # {head}{conversations}{tail}
    cpath = os.path.join(where, f"{head}{len(data)}{tail}")
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
        cache = prefix_cache(where, head, tail, data, log)
        cache = extend_cache(cache, data, lm_head, topk, lambda m: os.path.join(where, f"{head}{m}_partial{tail}"),
                             block, save_minutes, bf16)
        log(f"teacher cache: {len(data)} conversations in {time.time() - t0:.0f} s")
        save_whole(cache, cpath)
        for name in os.listdir(where):  # the partial caches of interrupted builds: this one holds them
            if name.startswith(head) and name.endswith(f"_partial{tail}"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(where, name))
        return cache


def extend_cache(cache: list, data, lm_head, topk: int, path_of, block: int, save_minutes: float, bf16: bool = False):
    """``cache`` (of ``data``'s first conversations) extended over the rest of ``data``, ``block`` conversations at
    a time under a bar of answer rows.  Every ``save_minutes`` the cache so far is written to ``path_of(m)`` (m
    conversations: a partial cache, which ``prefix_cache`` finds), the one written before removed."""
    from tqdm import tqdm

    left = answer_rows(data[len(cache):])
    written, saved = None, time.time()
    with tqdm(total=left, desc="teacher cache", unit="row", unit_scale=True, disable=left < 65536) as bar:
        for a in range(len(cache), len(data), block):
            cache += teacher_cache(data[a:a + block], lm_head, topk, bf16=bf16)
            bar.update(answer_rows(data[a:a + block]))
            if len(cache) < len(data) and time.time() - saved >= 60 * save_minutes:
                save_whole(cache, path_of(len(cache)))
                if written:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(written)
                written, saved = path_of(len(cache)), time.time()
    return cache


def answer_rows(samples) -> int:
    """The rows of ``samples`` the teacher cache computes: each feature whose next token is an answer token."""
    return sum(int(s.loss_mask[1:].sum()) for s in samples)


def save_whole(obj, path: str) -> None:
    """torch.save through a temporary file and a rename: a reader sees the whole file or none."""
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def prefix_cache(directory: str, head: str, tail: str, data, log=print) -> list:
    """The largest stored cache ``{head}{m}[_partial]_{tag}.pt`` in ``directory`` of no more conversations than
    ``data`` that fits its first ``m``, loaded; [] when there is none.  Any tag (``tail`` is this data set's): a
    recipe's extra sets grown by one more set begin with the sets of the run before, whose cache is reused.  It fits
    when each of its conversations has the data's length and its rows computed where the data has answer tokens."""
    found = []
    for name in os.listdir(directory):
        m = name[len(head):].split("_", 1)[0] if name.startswith(head) and name.endswith(".pt") else ""
        if m.isdigit() and 0 < int(m) <= len(data):  # (of as many: another data set's cache of the same ones)
            found.append((int(m), name.endswith(f"_partial{tail}") or name.endswith(tail), name))
    for m, _, name in sorted(found, reverse=True):
        cache = torch.load(os.path.join(directory, name), weights_only=False)
        if len(cache) == m and all(len(c["arg"]) == len(s.tokens) and torch.equal(c["arg"][:-1] >= 0,
                                                                                  s.loss_mask[1:].bool())
                                   for c, s in zip(cache, data)):
            log(f"teacher cache: the first {m} conversations' from {name}")
            return cache
    return []


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


def data_signature(train_set: list, val_set: list) -> dict:
    """What a run trains and evaluates on, in conversations and tokens (kept with its checkpoint, so that the run
    resumed on other data is refused rather than continued on it)."""
    return {part: [len(s), sum(int(x.tokens.numel()) for x in s)] for part, s in (("training", train_set),
                                                                                  ("held out", val_set))}


def split_held_out(data: list) -> tuple[list, list, int]:
    """(training, held-out, left out): the last 1/16 of the conversations (at least one) are held out, less
    those whose prompt a training conversation also has (ShareGPT repeats questions: 67 of the last 579 of
    its 9,276 usable first turns, whose greedy answers the drafter would have trained on)."""
    if len(data) < 2:
        raise ValueError(f"falcon-vllm: train: the data holds {len(data)} conversation(s); training needs at least "
                         "2 (one is held out), and many more to learn anything")
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


def check_aux(aux_layers, data: list, hidden: int, data_dir: str | None = None) -> None:
    """``data`` (read from ``data_dir``, if given) must carry exactly the states entering ``aux_layers`` (none when
    there are none): a drafter reading other layers, or none, would be trained or scored on the wrong input; and its
    final-norm states must be ``hidden`` wide (data made for another target is refused)."""
    if wrong := sorted({s.hidden.shape[1] for s in data} - {hidden}):
        raise ValueError(f"falcon-vllm: train: {data_dir or 'the data'} holds states {wrong[0]} wide, but the target's "
                         f"hidden size is {hidden}: it was made for another target (gen-data --target)")
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
