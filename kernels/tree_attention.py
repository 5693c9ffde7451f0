"""Tree attention over a paged KV prefix: a Triton kernel and its plain-torch reference.

Problem.  A batch of B requests.  Request b has ``P_b = prefix_lens[b]`` committed tokens whose
K/V sit in vLLM's paged cache, and ``W_b`` in-flight tokens (the tree's root + draft nodes, or a
drafter block) whose own K/V are passed densely.  In-flight token i of request b attends to all
``P_b`` prefix keys and, among the request's in-flight keys, to those j whose bit is set in its
row of the ancestor bitmask (its ancestors and itself).  A chain (causal decoding of W tokens) is
the special case "bit j set iff j <= i".  One kernel serves target verification (W = tree size)
and the drafter's SAR block passes.

Layouts (T = sum_b W_b; Hq query heads, Hkv kv heads, Hq % Hkv == 0; D = head_dim):

  q                [T, Hq, D]    fp16 / bf16 / fp32, in-flight queries, requests concatenated
  k, v             [T, Hkv, D]   in-flight keys / values (rotary already applied)
  key_cache,       [num_blocks, block_size, Hkv, D]   vLLM's FlashAttention ("NHD") paged layout,
  value_cache                    e.g. ``kv_cache[0]`` / ``kv_cache[1]`` of a vLLM layer; any strides
                                 with the last dim contiguous; block_size any positive integer
  block_table      [B, max_blocks_per_seq] int32   physical block of logical block n of request b
  prefix_lens      [B] int32     P_b >= 0 (need not be a multiple of block_size); prefix position p
                                 of request b is slot (block_table[b, p // block_size], p % block_size)
  query_start_loc  [B+1] int32   cumulative W_b (vLLM's varlen convention): request b owns rows
                                 query_start_loc[b] : query_start_loc[b+1] of q, k, v, tree_bits
  tree_bits        [T, n_words] int32   bit (j % 32) of word j // 32 of row i = in-flight token i may
                                 see in-flight token j of the same request (j counted from the
                                 request's first row).  n_words >= ceil(max W_b / 32).  Rows must be
                                 lower-triangular (j <= i: parents precede children, as in
                                 DecodingTree slot order) and have bit i set; the helpers below
                                 check this.  Build it with ``tree_bits_from_tree`` /
                                 ``tree_bits_from_parents`` / ``pack_tree_mask`` / ``batch_tree_bits``.
  scale            softmax scale (usually D ** -0.5)
  output           [T, Hq, D] in q's dtype.  GQA: query head h uses kv head h // (Hq // Hkv).

The drafter's SAR tree passes query only the newest of their in-flight tokens: the blocks of this
pass attend to their ancestor blocks of the earlier passes too.  For them ``kv_start_loc`` [B+1]
int32 gives the in-flight keys apart (k, v [sum_b WK_b, Hkv, D]); request b's W_b queries are its last
W_b in-flight tokens, and row i of ``tree_bits`` covers its WK_b in-flight keys.  A query row may also see
the rest of its own group of ``group`` rows (the k rows of a SAR block attend to each other); key j is
visible to query i only if j < WK_b - W_b + ceil((i + 1) / group) * group.

Algorithm: FlashAttention-2 style tiled attention with the online-softmax recurrence (running row
max m, normaliser l, un-normalised accumulator acc, all fp32; exp2 with log2(e) folded into the
scale), extended with (1) paged prefix reads through the block table and (2) an ancestor bitmask
over the in-flight keys, plus optional split-KV ("flash-decoding") over the prefix.

Kernel design (for H100 at verification shapes).  Verification reads the whole prefix K/V of every
request for only W <= 256 queries, so it is bound by the prefix KV read (arithmetic intensity
~ W * Hq / Hkv flops per KV byte), not by flops.  The schedule therefore minimises how often each
prefix KV byte is read:

* GQA packing: one program per (query tile, request, kv head [, prefix split]).  Its query tile
  stacks ``BLOCK_M`` rows = tokens x the Hq/Hkv query heads of that kv group (row r is token
  ``m0 + r // REP``, query head ``hk * REP + r % REP``), so each KV tile is loaded once for the
  whole group and feeds one ``tl.dot`` of M = BLOCK_M rows instead of REP separate passes.
  BLOCK_M grows with W * REP up to 64 (H100: 64-row tiles beat one 128-row tile even where the 128-row
  tile would read the prefix once: more programs in flight), so for W * REP <= 64 the prefix is read once.
* Paged prefix: a KV tile of BLOCK_N positions looks up each position's physical block in the
  block table (one int32 per key, L1/L2 resident) and loads contiguous D-element rows, so any
  block size works and no dense gather copy is materialised.
* In-flight keys come after the prefix in 32-key tiles, one bitmask word per query row per tile
  (``(word >> lane) & 1``).  A query tile only visits keys up to its last token (lower-triangular
  masks), so a 256-node tree costs roughly half of a dense W x W block.
* Split-KV: with few requests (B * Hkv * tiles well below the SM count) the prefix is cut into
  ``num_splits`` contiguous chunks handled by separate programs (the last split also owns the
  in-flight keys) that write normalised partials (o = acc / l in q's dtype, lse = m + log2 l in
  fp32).  By default the merge is fused: each program bumps an arrival counter for its query
  tile, and the last to arrive merges the partials (read back from L2) and writes the output, so
  the step is one launch; a separate combine kernel is the alternative (``fuse_combine=False``).
  The default picks splits from the SM count and the longest prefix (>= 256 keys per split).
* Fully masked tiles are handled without NaNs (row max -inf is replaced by 0 before exp2), and
  rows outside the request (padding of the last tile) are never stored.

Limits: head_dim a power of two in [16, 256]; q/k/v/caches/out contiguous in the last dim.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton use the reference
    triton = None

WORD_BITS = 32  # bits per tree_bits word (int32)


# ----------------------------------------------------------------------------- bitmask helpers
def _to_int32_words(words64: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the same 32 bits as int32 (two's complement)."""
    return torch.where(words64 >= 2 ** 31, words64 - 2 ** 32, words64).to(torch.int32)


def pack_tree_mask(mask: torch.Tensor, num_words: Optional[int] = None) -> torch.Tensor:
    """Pack a boolean visibility mask into ``tree_bits`` rows.

    Args:
        mask: [W, W] bool, ``mask[i, j]`` = in-flight token i may see in-flight token j.  Must be
            lower-triangular with a true diagonal (e.g. ``DecodingTree.ancestor_mask``).
        num_words: words per row (default ``ceil(W / 32)``); pad to a batch-wide count.

    Returns:
        [W, num_words] int32: bit ``j % 32`` of word ``j // 32`` of row i is ``mask[i, j]``.
    """
    mask = torch.as_tensor(mask).to("cpu", torch.bool)
    W = mask.shape[0]
    if mask.dim() != 2 or mask.shape[1] != W:
        raise ValueError(f"falcon-vllm: pack_tree_mask: mask must be [W, W], got {tuple(mask.shape)}")
    if torch.triu(mask, 1).any():
        raise ValueError("falcon-vllm: pack_tree_mask: token i may only see tokens j <= i (parents before children)")
    if W and not mask.diagonal().all():
        raise ValueError("falcon-vllm: pack_tree_mask: every in-flight token must see itself (diagonal all true)")
    return pack_mask_rows(mask, num_words)


def pack_mask_rows(mask: torch.Tensor, num_words: Optional[int] = None) -> torch.Tensor:
    """[R, C] bool -> [R, num_words] int32, bit ``j % 32`` of word ``j // 32`` of row i = ``mask[i, j]``;
    any mask (:func:`pack_tree_mask` checks a tree's first).  For queries apart from their in-flight keys."""
    mask = torch.as_tensor(mask).to("cpu", torch.bool)
    R, C = mask.shape
    need = (C + WORD_BITS - 1) // WORD_BITS
    num_words = need if num_words is None else num_words
    if num_words < need:
        raise ValueError(f"falcon-vllm: pack_mask_rows: {C} columns need {need} words, got num_words={num_words}")
    padded = torch.zeros(R, num_words * WORD_BITS, dtype=torch.int64)
    padded[:, :C] = mask.long()
    lanes = torch.arange(WORD_BITS, dtype=torch.int64)
    words = (padded.view(R, num_words, WORD_BITS) << lanes).sum(-1)      # [R, num_words] int64
    return _to_int32_words(words)


def unpack_tree_bits(tree_bits: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_tree_mask`: [N, n_words] int32 -> [N, width] bool (columns < width)."""
    lanes = torch.arange(WORD_BITS, device=tree_bits.device, dtype=torch.int32)
    bits = (tree_bits.to(torch.int32).unsqueeze(-1) >> lanes) & 1          # [N, n_words, 32]
    return bits.flatten(1)[:, :width].bool()


def ancestor_mask_from_parents(parent: torch.Tensor) -> torch.Tensor:
    """[W] int parent index (-1 for a root, parent[i] < i) -> [W, W] bool ancestor-or-self mask."""
    parent = torch.as_tensor(parent).to("cpu", torch.long)
    W = parent.numel()
    idx = torch.arange(W)
    if ((parent >= idx) | (parent < -1)).any():
        raise ValueError("falcon-vllm: ancestor_mask_from_parents: need -1 <= parent[i] < i (parents before children)")
    mask = torch.eye(W, dtype=torch.bool)
    cur = parent.clone()
    while (cur >= 0).any():                       # pointer jumping, one level per step (<= depth)
        live = cur >= 0
        mask[idx[live], cur[live]] = True
        cur = torch.where(live, parent[cur.clamp(min=0)], cur)
    return mask


def tree_bits_from_parents(parent: torch.Tensor, num_words: Optional[int] = None) -> torch.Tensor:
    """[W] parent indices (-1 = root, parent[i] < i) -> [W, num_words] int32 tree_bits."""
    return pack_tree_mask(ancestor_mask_from_parents(parent), num_words)


def tree_bits_from_tree(tree, num_words: Optional[int] = None) -> torch.Tensor:
    """A ``DecodingTree`` (slot 0 = root) -> [num_slots, num_words] int32 tree_bits."""
    return pack_tree_mask(tree.ancestor_mask, num_words)


def causal_tree_bits(width: int, num_words: Optional[int] = None) -> torch.Tensor:
    """A chain of ``width`` tokens (plain causal attention) -> [width, num_words] int32."""
    return pack_tree_mask(torch.ones(width, width, dtype=torch.bool).tril(), num_words)


def batch_tree_bits(items: Sequence, num_words: Optional[int] = None) -> torch.Tensor:
    """Concatenate per-request bitmasks into the [T, n_words] int32 ``tree_bits`` of a batch.

    Each item is a ``DecodingTree``, a [W, W] bool mask, or a [W] parent-index tensor/list.  The
    word count is common to the batch (default: enough for the widest request).
    """
    masks = []
    for it in items:
        if hasattr(it, "ancestor_mask"):
            masks.append(it.ancestor_mask)
        else:
            t = torch.as_tensor(it)
            masks.append(t.bool() if t.dim() == 2 else ancestor_mask_from_parents(t))
    need = max([(m.shape[0] + WORD_BITS - 1) // WORD_BITS for m in masks] + [1])
    num_words = need if num_words is None else num_words
    if not masks:
        return torch.zeros(0, num_words, dtype=torch.int32)
    return torch.cat([pack_tree_mask(m, num_words) for m in masks])


# ----------------------------------------------------------------------------- reference
def tree_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_table: torch.Tensor, prefix_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, tree_bits: torch.Tensor, scale: float, *,
                       out: Optional[torch.Tensor] = None, kv_start_loc: Optional[torch.Tensor] = None,
                       **_hints) -> torch.Tensor:
    """Plain-torch tree attention (the CPU path and the kernels' test oracle).

    Same arguments, shapes and result as :func:`tree_attention` (see the module docstring):
    q [T, Hq, D], k/v [T, Hkv, D] (or [sum WK_b, Hkv, D] with ``kv_start_loc``), key/value_cache
    [num_blocks, block_size, Hkv, D], block_table [B, max_blocks] int32, prefix_lens [B] int32,
    query_start_loc [B+1] int32, tree_bits [T, n_words] int32 (any mask is honoured here, not only
    lower-triangular ones);
    returns [T, Hq, D] in q's dtype (written into ``out`` when given).  Tuning hints accepted by
    the kernel (``max_query_len``, ``num_splits``, ...) are ignored.

    Per request: gather the prefix K/V through the block table, append the in-flight K/V, and run
    ``scaled_dot_product_attention`` (fp32, grouped-query) with the boolean mask
    [all prefix | unpacked tree bits].  One host sync for the request offsets.
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"falcon-vllm: tree_attention_ref: Hq={Hq} is not a multiple of Hkv={Hkv}")
    bs = key_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    kstarts = starts if kv_start_loc is None else kv_start_loc.tolist()
    plens = prefix_lens.tolist()
    for b in range(len(starts) - 1):
        s, e, P = starts[b], starts[b + 1], plens[b]
        ks, ke = kstarts[b], kstarts[b + 1]
        W = e - s
        if W == 0:
            continue
        blocks = block_table[b, :(P + bs - 1) // bs].long()
        kp = key_cache[blocks].reshape(-1, Hkv, D)[:P]                    # [P, Hkv, D]
        vp = value_cache[blocks].reshape(-1, Hkv, D)[:P]
        keys = torch.cat([kp, k[ks:ke]]).float().transpose(0, 1)          # [Hkv, P+WK, D]
        vals = torch.cat([vp, v[ks:ke]]).float().transpose(0, 1)
        allowed = torch.ones(W, P + ke - ks, dtype=torch.bool, device=q.device)  # [W, P+WK]
        allowed[:, P:] = unpack_tree_bits(tree_bits[s:e], ke - ks)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].float().transpose(0, 1), keys, vals, attn_mask=allowed, scale=scale,
            enable_gqa=Hq != Hkv)                                         # [Hq, W, D]
        out[s:e] = o.transpose(0, 1).to(out.dtype)
    return out


# ----------------------------------------------------------------------------- Triton kernels
if triton is not None:
    @triton.jit
    def _online_softmax_tile(q, kt, vt, visible, acc, m_i, l_i, scale_log2e,
                             DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
        """One key tile of the online softmax: scores q kt^T (log2 domain) where ``visible``, then the
        running row max m_i, normaliser l_i and accumulator acc rescaled and updated with the tile's
        values vt.  Rows with no visible key yet keep m_i = -inf without NaNs (their max is taken as 0)."""
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * scale_log2e
        s = tl.where(visible, s, float("-inf"))                          # [BLOCK_M, keys]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        l_i = l_i * alpha + tl.sum(p, 1)
        return acc, m_new, l_i

    @triton.jit
    def _tree_attn_fwd(Q, K, V, KC, VC, BT, PL, QSL, KSL, BITS, O, PACC, PLSE, LOCK, scale_log2e,
                       s_qt, s_qh, s_kt, s_kh, s_vt, s_vh,
                       s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
                       s_bt, s_bits, s_ot, s_oh, s_pa_s, s_pa_t, s_pm_s, s_pm_t,
                       REP: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, TOK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, FUSE: tl.constexpr, BALANCE: tl.constexpr,
                       DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
        tile = tl.program_id(0)
        b = tl.program_id(1)
        hk = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
        start = tl.load(QSL + b)
        W = tl.load(QSL + b + 1) - start
        # the request's in-flight keys (its queries are the last W of them; KSL is QSL unless given apart)
        k_start = tl.load(KSL + b)
        WK = tl.load(KSL + b + 1) - k_start
        q_off = WK - W
        m0 = tile * TOK_M
        if m0 >= W:
            return
        # packed query rows: token m0 + r // REP, query head hk * REP + r % REP
        r = tl.arange(0, BLOCK_M)
        tok = m0 + r // REP                                              # [BLOCK_M]
        head = hk * REP + r % REP
        row_ok = (r < TOK_M * REP) & (tok < W)
        row = (start + tok).to(tl.int64)
        d = tl.arange(0, D)
        q = tl.load(Q + row[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)                     # [BLOCK_M, D]
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)

        # this split's keys: a share of the committed prefix [lo, hi) and of the in-flight keys [j_lo, j_hi)
        # this tile can see (none past the end of its last token's GROUP of rows).  Default: the prefix cut
        # in NUM_SPLITS chunks, the in-flight keys all in the last split.  BALANCE: the prefix (padded to 32)
        # followed by the in-flight keys cut as one sequence, so the last split is no straggler.
        P = tl.load(PL + b)
        j_all = tl.minimum(WK, q_off + tl.cdiv(tl.minimum(W, m0 + TOK_M), GROUP) * GROUP)
        if BALANCE:
            p_pad = tl.cdiv(P, 32) * 32
            chunk = tl.cdiv(tl.cdiv(p_pad + j_all, NUM_SPLITS), 64) * 64      # a multiple of 32: word-aligned
            lo = split * chunk
            hi = tl.minimum(lo + chunk, P)
            j_lo = tl.maximum(lo - p_pad, 0)
            j_hi = tl.minimum(tl.maximum(lo + chunk - p_pad, 0), j_all)
        else:
            chunk = tl.cdiv(tl.cdiv(P, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, P)
            j_lo = 0
            j_hi = tl.where(split == NUM_SPLITS - 1, j_all, 0)

        # 1) the prefix share, read through the block table
        n = tl.arange(0, BLOCK_N)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + n
            key_ok = pos < hi                                            # [BLOCK_N]
            blk = tl.load(BT + b * s_bt + pos // PAGE, mask=key_ok, other=0).to(tl.int64)
            off = pos % PAGE
            kt = tl.load(KC + (blk * s_kcb + off * s_kcs + hk * s_kch)[:, None] + d[None, :],
                         mask=key_ok[:, None], other=0.0)                # [BLOCK_N, D]
            vt = tl.load(VC + (blk * s_vcb + off * s_vcs + hk * s_vch)[:, None] + d[None, :],
                         mask=key_ok[:, None], other=0.0)
            acc, m_i, l_i = _online_softmax_tile(q, kt, vt, key_ok[None, :], acc, m_i, l_i, scale_log2e,
                                                 DOT_PREC, UPCAST)

        # 2) the in-flight share, 32 keys per tile = one bitmask word per row
        lane = tl.arange(0, 32)
        for j0 in range(j_lo, j_hi, 32):
            j = j0 + lane
            kv_ok = j < WK
            word = tl.load(BITS + row * s_bits + j0 // 32, mask=row_ok, other=0)   # [BLOCK_M] int32
            vis = (((word[:, None] >> lane[None, :]) & 1) != 0) & kv_ok[None, :]
            krow = (k_start + j).to(tl.int64)
            kt = tl.load(K + krow[:, None] * s_kt + hk * s_kh + d[None, :], mask=kv_ok[:, None], other=0.0)
            vt = tl.load(V + krow[:, None] * s_vt + hk * s_vh + d[None, :], mask=kv_ok[:, None], other=0.0)
            acc, m_i, l_i = _online_softmax_tile(q, kt, vt, vis, acc, m_i, l_i, scale_log2e, DOT_PREC, UPCAST)

        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(O + row[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                     o.to(O.dtype.element_ty), mask=row_ok[:, None])
        else:
            # split partials, normalised: o_s = acc / l in PACC's dtype [S, T, Hq, D] (bounded by max |v|, so
            # fp16/bf16 hold it) and lse_s = m + log2 l in fp32 PLSE [S, T, Hq] (-inf: the split saw no key)
            l_ok = l_i > 0.0
            l_safe = tl.where(l_ok, l_i, 1.0)
            tl.store(PACC + split * s_pa_s + row[:, None] * s_pa_t + head[:, None] * D + d[None, :],
                     (acc / l_safe[:, None]).to(PACC.dtype.element_ty), mask=row_ok[:, None])
            tl.store(PLSE + split * s_pm_s + row * s_pm_t + head,
                     tl.where(l_ok, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)
            if FUSE:
                # the last split of this (tile, request, kv head) to finish merges all partials (one launch):
                # the barrier makes every thread's partial stores visible before the release (acq_rel, gpu
                # scope) of the arrival counter; the last arrival resets the counter for the next launch and
                # reads the partials from L2 (.cg: never a stale L1 line)
                tl.debug_barrier()
                lock = LOCK + (b * (tl.num_programs(2) // NUM_SPLITS) + hk) * tl.num_programs(0) + tile
                arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
                if arrived == NUM_SPLITS - 1:
                    tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")
                    sp = tl.arange(0, SPLITS_P2)
                    lse = tl.load(PLSE + sp[:, None] * s_pm_s + (row * s_pm_t + head)[None, :],
                                  mask=(sp[:, None] < NUM_SPLITS) & row_ok[None, :], other=float("-inf"),
                                  cache_modifier=".cg")                  # [S, BLOCK_M]
                    m_max = tl.max(lse, 0)
                    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
                    den = tl.sum(tl.exp2(lse - m_max[None, :]), 0)
                    o = tl.zeros((BLOCK_M, D), tl.float32)
                    for s in range(NUM_SPLITS):
                        w = tl.exp2(tl.load(PLSE + s * s_pm_s + row * s_pm_t + head, mask=row_ok,
                                            other=float("-inf"), cache_modifier=".cg") - m_max)
                        part = tl.load(PACC + s * s_pa_s + row[:, None] * s_pa_t + head[:, None] * D + d[None, :],
                                       mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
                        o += w[:, None] * part.to(tl.float32)
                    o = o / tl.where(den == 0.0, 1.0, den)[:, None]
                    tl.store(O + row[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                             o.to(O.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _tree_attn_combine(PACC, PLSE, O, s_pa_s, s_pa_t, s_pm_s, s_pm_t, s_ot, s_oh, Hq,
                           D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                           BLOCK_H: tl.constexpr):
        """out[t, h] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s (a separate launch)."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)          # [BLOCK_H]
        h_ok = h < Hq
        sp = tl.arange(0, SPLITS_P2)
        ok = (sp[:, None] < NUM_SPLITS) & h_ok[None, :]                  # [S, BLOCK_H]
        lse = tl.load(PLSE + sp[:, None] * s_pm_s + t * s_pm_t + h[None, :], mask=ok, other=float("-inf"))
        m_max = tl.max(lse, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(lse - m_max[None, :])                                 # [S, BLOCK_H]
        den = tl.sum(w, 0)
        d = tl.arange(0, D)
        part = tl.load(PACC + (sp[:, None] * s_pa_s + t * s_pa_t + h[None, :] * D)[:, :, None] + d[None, None, :],
                       mask=ok[:, :, None], other=0.0)                    # [S, BLOCK_H, D]
        o = tl.sum(w[:, :, None] * part.to(tl.float32), 0) / tl.where(den == 0.0, 1.0, den)[:, None]
        tl.store(O + t * s_ot + h[:, None] * s_oh + d[None, :], o.to(O.dtype.element_ty),
                 mask=h_ok[:, None])


_LOCKS: dict = {}


def _split_locks(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the fused combine, one per (tile, request, kv head), kept per device
    (each launch's last arrivals reset theirs to zero, so the buffer is reused, CUDA-graph replays too).
    Launches on one device must not overlap (one stream, as vLLM's model runner has); a first call with a
    larger batch grows the buffer, so under CUDA-graph capture run the largest shape once before capturing."""
    buf = _LOCKS.get(device)
    if buf is None or buf.numel() < n:
        buf = _LOCKS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def default_config(max_query_len: int, rep: int, head_dim: int) -> dict:
    """Tile sizes: BLOCK_M packed rows (tokens x group heads), BLOCK_N prefix keys per tile."""
    # Measured on H100 (benchmarks/results/kernels_sweep_*): 64 packed rows per tile beat 128 even
    # when one tile would hold the whole tree (more programs in flight, fewer registers each).
    rows = triton.next_power_of_2(max(1, max_query_len) * rep)
    block_m = max(min(64, max(16, rows)), triton.next_power_of_2(rep))
    big = block_m * head_dim >= 128 * 128
    return {"block_m": block_m, "block_n": 64 if head_dim <= 128 else 32,
            "num_warps": 8 if big else 4, "num_stages": 2, "partials": "half", "fuse_combine": True,
            "balance": False}


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_table: torch.Tensor, prefix_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, tree_bits: torch.Tensor, scale: float, *,
                   out: Optional[torch.Tensor] = None, max_query_len: Optional[int] = None,
                   max_prefix_len: Optional[int] = None, num_splits: Optional[int] = None,
                   config: Optional[dict] = None, kv_start_loc: Optional[torch.Tensor] = None,
                   group: int = 1) -> torch.Tensor:
    """Triton tree attention; shapes and semantics in the module docstring.

    Args (beyond the tensors):
        scale: softmax scale.
        out: optional [T, Hq, D] output buffer (q's dtype).
        max_query_len: max_b W_b.  Pass it (vLLM's metadata has it) to avoid a device sync.
        max_prefix_len: max_b P_b, used only to choose ``num_splits``; pass it to avoid a sync.
        num_splits: prefix splits (split-KV); default from the SM count and ``max_prefix_len``.
        kv_start_loc: [B+1] int32, the in-flight keys apart from the queries (the queries of a request are
            its last in-flight tokens); default ``query_start_loc``.
        group: rows that see each other whole (a SAR block's k rows); 1 for trees and chains.
        config: override tile sizes: ``block_m``, ``block_n``, ``num_warps``, ``num_stages``; and the
            split-KV merge: ``partials`` ("half": q's dtype, "fp32") and ``fuse_combine`` (True: the last
            split to finish merges, one launch; False: a separate combine launch); ``balance`` (True: the
            in-flight keys shared among the splits with the prefix instead of all in the last split).

    Returns:
        [T, Hq, D] in q's dtype.
    """
    if triton is None:
        raise RuntimeError("falcon-vllm: triton is not installed; use tree_attention_ref")
    T, Hq, D = q.shape
    B = block_table.shape[0]
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"falcon-vllm: tree_attention: Hq={Hq} is not a multiple of Hkv={Hkv}")
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"falcon-vllm: tree_attention: head_dim must be a power of two in [16, 256], got {D}")
    for name, t in (("q", q), ("k", k), ("v", v), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"falcon-vllm: tree_attention: {name} must be contiguous in its last dim")
    out = torch.empty_like(q) if out is None else out
    if T == 0:
        return out
    if group < 1:
        raise ValueError(f"falcon-vllm: tree_attention: group must be >= 1, got {group}")
    rep = Hq // Hkv
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    cfg = default_config(max_query_len, rep, D)
    cfg.update(config or {})
    block_m = cfg["block_m"]
    tok_m = block_m // rep
    if tok_m < 1:
        raise ValueError(f"falcon-vllm: tree_attention: block_m={block_m} is smaller than the GQA group {rep}")
    n_tiles = triton.cdiv(max_query_len, tok_m)
    if num_splits is None:
        base = n_tiles * B * Hkv
        sms = _num_sms(q.device)
        if base >= sms:
            num_splits = 1
        else:
            if max_prefix_len is None:
                max_prefix_len = int(prefix_lens.max()) if B else 0
            # about two programs per SM, at least 256 prefix keys per split, a power of two
            # (uneven BLOCK_N-rounded chunks leave the last split short; measured slower)
            s = max(1, min(2 * sms // base, max_prefix_len // 256, 32))
            num_splits = 1 << (s.bit_length() - 1)
    if num_splits > 1 and "num_stages" not in (config or {}):
        # split-KV is the latency-bound regime (few programs): a third pipeline stage keeps more K/V loads in
        # flight; at batch 1 on H100 it took the goal shape from 43.4 to 40.4 us (kernels_b1_pipeline_h100.md)
        cfg["num_stages"] = 3
    # Triton's CPU interpreter computes tl.dot on bf16 operands wrongly (numpy has no bf16): there the
    # kernel upcasts its tiles to fp32 first.  On GPU bf16 tiles go to the tensor cores as they are.
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    dot_prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    fuse = num_splits > 1 and cfg["fuse_combine"]
    if num_splits > 1:
        pdt = q.dtype if cfg["partials"] == "half" else torch.float32
        pacc = torch.empty(num_splits, T, Hq, D, device=q.device, dtype=pdt)
        plse = torch.empty(num_splits, T, Hq, device=q.device, dtype=torch.float32)
    else:
        pacc = plse = torch.empty(1, 1, 1, device=q.device, dtype=torch.float32)
    locks = _split_locks(q.device, n_tiles * B * Hkv) if fuse else plse
    _tree_attn_fwd[(n_tiles, B, Hkv * num_splits)](
        q, k, v, key_cache, value_cache, block_table, prefix_lens, query_start_loc,
        query_start_loc if kv_start_loc is None else kv_start_loc, tree_bits, out,
        pacc, plse, locks, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), tree_bits.stride(0), out.stride(0), out.stride(1),
        pacc.stride(0), pacc.stride(1), plse.stride(0), plse.stride(1),
        REP=rep, PAGE=key_cache.shape[1], D=D, GROUP=group, BLOCK_M=block_m, TOK_M=tok_m,
        BLOCK_N=cfg["block_n"], NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits),
        FUSE=fuse, BALANCE=num_splits > 1 and cfg["balance"], DOT_PREC=dot_prec, UPCAST=upcast,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if num_splits > 1 and not fuse:
        # heads per combine program; profiled on H100 (benchmarks/results/kernels_profile_h100.txt):
        # 1 is fastest for few tokens (more programs), 4 for W = 128 at batch 1
        block_h = min(cfg.get("combine_block_h", 1 if T <= 64 else 4), triton.next_power_of_2(Hq))
        _tree_attn_combine[(T, triton.cdiv(Hq, block_h))](
            pacc, plse, out, pacc.stride(0), pacc.stride(1), plse.stride(0), plse.stride(1),
            out.stride(0), out.stride(1), Hq, D=D, NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits), BLOCK_H=block_h)
    return out
