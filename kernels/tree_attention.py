"""Tree attention over a paged KV prefix (Triton) and its plain-torch reference.

Each request b has ``prefix_lens[b]`` committed tokens in vLLM's paged cache and ``W_b`` in-flight
tree tokens (root + draft nodes).  A tree token sees the whole prefix and, among the in-flight
tokens of its request, only its ancestors and itself, given as a bitmask.  One kernel serves target
verification (W = tree size) and the drafter's SAR block passes (a block = a tiny tree).

Layouts:
  q:            [T, Hq, D]       in-flight queries, requests concatenated (varlen, ``query_start_loc``)
  k, v:         [T, Hkv, D]      in-flight keys/values (already rotary-embedded)
  key_cache:    [num_blocks, block_size, Hkv, D]   (vLLM FlashAttention layout; same for value_cache)
  block_table:  [B, max_blocks] int32;  prefix_lens: [B] int32;  query_start_loc: [B+1] int32
  tree_bits:    [T, ceil(W_max/32)] int32: bit j of row i = token i may see in-flight token j of its
                request (j counted from the request's first in-flight token)
Output: [T, Hq, D] in q's dtype.  GQA: query head h reads kv head h // (Hq // Hkv).

Kernel design: one program per (in-flight token, query head); it streams the prefix in tiles of
BLOCK_N keys through the block table, then the request's in-flight keys under the bitmask, with the
online-softmax recurrence (running max m, normaliser l, accumulator acc; exp2 with log2(e) folded
into the scale) in fp32.  This is the simple, obviously-correct schedule; the GPU-efficient
variant (one program per (request, kv head, query tile) reading each KV tile once for every query
head of its group, since verification is bound by the prefix KV read) is future work and needs a
GPU to tune.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton use the reference
    triton = None


def tree_bits_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[W, W] bool ancestor mask -> [W, ceil(W/32)] int32 bit words."""
    W = mask.shape[0]
    words = (W + 31) // 32
    out = torch.zeros(W, words, dtype=torch.int64)
    for w in range(words):
        blk = mask[:, w * 32:(w + 1) * 32].long()
        out[:, w] = (blk << torch.arange(blk.shape[1])).sum(1)
    out = torch.where(out >= 2 ** 31, out - 2 ** 32, out)  # reinterpret as int32
    return out.to(torch.int32)


def bits_for_batch(masks: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-request ancestor masks into [sum W, words] with a common word count."""
    words = max((m.shape[0] + 31) // 32 for m in masks)
    rows = []
    for m in masks:
        b = tree_bits_from_mask(m)
        rows.append(torch.nn.functional.pad(b, (0, words - b.shape[1])))
    return torch.cat(rows)


def _unpack(bits_row: torch.Tensor, W: int) -> torch.Tensor:
    j = torch.arange(W)
    words = bits_row.long()[j // 32] & 0xFFFFFFFF
    return ((words >> (j % 32)) & 1).bool()


def tree_attention_ref(q, k, v, key_cache, value_cache, block_table, prefix_lens, query_start_loc, tree_bits,
                       scale: float) -> torch.Tensor:
    """Plain-torch reference (also the CPU path).  Same arguments as :func:`tree_attention`."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    rep = Hq // Hkv
    bs = key_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(block_table.shape[0]):
        s, e = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if e == s:
            continue
        P, W = int(prefix_lens[b]), e - s
        nblk = (P + bs - 1) // bs
        blocks = block_table[b, :nblk].long()
        kp = key_cache[blocks].reshape(-1, Hkv, D)[:P]                     # [P, Hkv, D]
        vp = value_cache[blocks].reshape(-1, Hkv, D)[:P]
        keys = torch.cat([kp, k[s:e]]).float().repeat_interleave(rep, 1)   # [P+W, Hq, D]
        vals = torch.cat([vp, v[s:e]]).float().repeat_interleave(rep, 1)
        allowed = torch.ones(W, P + W, dtype=torch.bool)
        allowed[:, P:] = torch.stack([_unpack(tree_bits[s + i], W) for i in range(W)])
        scores = torch.einsum("whd,nhd->hwn", q[s:e].float(), keys) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[s:e] = torch.einsum("hwn,nhd->whd", scores.softmax(-1), vals).to(q.dtype)
    return out


if triton is not None:
    @triton.jit
    def _tree_attn_kernel(Q, K, V, KC, VC, BT, PL, QSL, BITS, O, scale_log2e,
                          sq_t, sq_h, sk_t, sk_h, skc_b, skc_s, skc_h, sbt_b, sbits_t, so_t, so_h,
                          NUM_WORDS: tl.constexpr, REP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          D: tl.constexpr, BLOCK_N: tl.constexpr, MAX_REQS: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        hk = h // REP
        # find the request of token t (few requests: linear scan of query_start_loc)
        req = 0
        for r in tl.static_range(MAX_REQS):  # query_start_loc is sorted: count requests ending <= t
            req += (tl.load(QSL + r + 1) <= t).to(tl.int32)
        start = tl.load(QSL + req)
        end = tl.load(QSL + req + 1)
        P = tl.load(PL + req)
        d = tl.arange(0, D)
        q = tl.load(Q + t * sq_t + h * sq_h + d).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        l = tl.zeros((), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        n_off = tl.arange(0, BLOCK_N)
        # 1) the committed prefix, through the block table
        for n0 in range(0, P, BLOCK_N):
            pos = n0 + n_off
            valid = pos < P
            blk = tl.load(BT + req * sbt_b + pos // BLOCK_SIZE, mask=valid, other=0)
            base = blk.to(tl.int64) * skc_b + (pos % BLOCK_SIZE) * skc_s + hk * skc_h
            kt = tl.load(KC + base[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(kt * q[None, :], 1) * scale_log2e
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked tile adds nothing
            p = tl.exp2(s - m_safe)
            alpha = tl.exp2(m - m_safe)
            vt = tl.load(VC + base[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * vt, 0)
            l = l * alpha + tl.sum(p, 0)
            m = m_new
        # 2) the in-flight tree tokens of this request, under the ancestor bitmask
        W = end - start
        for j0 in range(0, W, BLOCK_N):
            j = j0 + n_off
            inb = j < W
            word = tl.load(BITS + t * sbits_t + j // 32, mask=inb, other=0)
            vis = inb & (((word >> (j % 32)) & 1) == 1)
            rows = (start + j).to(tl.int64)
            kt = tl.load(K + rows[:, None] * sk_t + hk * sk_h + d[None, :], mask=vis[:, None], other=0.0)
            s = tl.sum(kt.to(tl.float32) * q[None, :], 1) * scale_log2e
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe)
            alpha = tl.exp2(m - m_safe)
            vt = tl.load(V + rows[:, None] * sk_t + hk * sk_h + d[None, :], mask=vis[:, None], other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), 0)
            l = l * alpha + tl.sum(p, 0)
            m = m_new
        tl.store(O + t * so_t + h * so_h + d, (acc / l).to(O.dtype.element_ty))


def tree_attention(q, k, v, key_cache, value_cache, block_table, prefix_lens, query_start_loc, tree_bits,
                   scale: float, block_n: int = 32) -> torch.Tensor:
    """Triton tree attention (see module docstring for shapes).  Every token sees itself, so every
    softmax row has at least one finite score."""
    if triton is None:
        raise RuntimeError("triton is not installed; use tree_attention_ref")
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    assert Hq % Hkv == 0, "query heads must be a multiple of kv heads (GQA)"
    assert D & (D - 1) == 0, "head_dim must be a power of two"
    out = torch.empty_like(q)
    B = block_table.shape[0]
    grid = (T, Hq)
    _tree_attn_kernel[grid](
        q, k, v, key_cache, value_cache, block_table, prefix_lens, query_start_loc, tree_bits, out,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0), tree_bits.stride(0),
        out.stride(0), out.stride(1),
        NUM_WORDS=tree_bits.shape[1], REP=Hq // Hkv, BLOCK_SIZE=key_cache.shape[1], D=D, BLOCK_N=block_n,
        MAX_REQS=B)
    return out
