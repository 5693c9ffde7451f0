"""K/V compaction after tree verification (Triton) and its plain-torch reference.

After acceptance the accepted path's K/V sit at scattered slots (their tree positions); they are
moved to consecutive slots right after the prefix, for every layer in one launch, so that vLLM's
rollback (``num_computed -= rejected``) and prefix caching see a contiguous sequence.

Layout: ``caches`` is one tensor [L, num_blocks, block_size, Hkv, D] (a stack of per-layer K or V
caches; call once for K and once for V, or stack both as 2L layers).  ``src``/``dst`` are flat slot
indices (``block_id * block_size + offset``) [N] int64 with, per request, dst increasing and
dst <= src (a path is moved towards the prefix).  Under that ordering copying the pairs in order is
safe even when a destination is another pair's source; the kernel gives each program one (layer,
head) and walks the pairs in order.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def kv_compaction_ref(caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In-place reference: for every layer, slot dst[i] <- slot src[i], pairs in order."""
    L = caches.shape[0]
    flat = caches.view(L, -1, *caches.shape[3:])  # [L, slots, Hkv, D]
    for s, d in zip(src.tolist(), dst.tolist()):
        if s != d:
            flat[:, d] = flat[:, s]


if triton is not None:
    @triton.jit
    def _kv_compact_kernel(C, SRC, DST, N, s_layer, s_slot, s_head, D: tl.constexpr):
        layer = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, D)
        base = C + layer.to(tl.int64) * s_layer + head * s_head
        for i in range(N):  # in order: see the module docstring
            s = tl.load(SRC + i).to(tl.int64)
            t = tl.load(DST + i).to(tl.int64)
            x = tl.load(base + s * s_slot + d)
            tl.store(base + t * s_slot + d, x)


def kv_compaction(caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Triton version of :func:`kv_compaction_ref` (one launch for all layers and heads)."""
    if triton is None:
        raise RuntimeError("triton is not installed; use kv_compaction_ref")
    L, nb, bs, H, D = caches.shape
    assert D & (D - 1) == 0, "head_dim must be a power of two"
    flat = caches.view(L, nb * bs, H, D)
    _kv_compact_kernel[(L, H)](flat, src, dst, src.numel(), flat.stride(0), flat.stride(1), flat.stride(2), D=D)
