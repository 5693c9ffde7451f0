"""K/V compaction after tree verification: a Triton kernel and its plain-torch reference.

After acceptance, the accepted path's K/V sit at the slots of their tree positions (scattered); they
are moved to consecutive slots right after the prefix so that vLLM's cache (rollback of rejected
tokens, prefix caching) sees a contiguous sequence.  One launch moves every layer, K and V.

Caches ("planes").  The unit is a *plane*: a tensor [num_blocks, block_size, Hkv, D] in vLLM's
FlashAttention ("NHD") layout, any strides with a contiguous last dim, any dtype (the kernel copies
bits: fp16, bf16, fp32, fp8).  A model has 2 L planes (K and V of each layer).  ``caches`` is one of

  * a sequence of planes, all with the same shape, dtype and strides (e.g.
    ``vllm_planes(kv_caches)`` for vLLM 0.32 layer caches [num_blocks, Hkv, block_size, 2 D]);
  * a stacked tensor [N, num_blocks, block_size, Hkv, D] (N planes);
  * a :class:`PlaneTable` built once with :func:`plane_table` (the device pointer table the kernel
    reads; build it at start-up, cache tensors do not move).

Slots.  A flat slot is ``block_id * block_size + offset``.  ``src`` / ``dst`` are int32/int64 either
[N] (pairs of all requests concatenated) or [B, A] with ``counts`` [B] (row b holds request b's
pairs; entries at a >= counts[b] are ignored).  Every plane gets ``slot[dst[i]] <- slot[src[i]]``.
Pairs with src == dst are skipped.

Overlap.  Source and destination ranges may overlap (accepted node slots sit at or after their
destinations).  Required per request: dst strictly increasing and dst[i] <= src[i]; requests use
disjoint slots.  Then no pair reads a slot that an earlier pair of its request wrote
(dst[k] < dst[i] <= src[i] for k < i), so the result equals "read every source, then write every
destination" and equals copying pair by pair in order.

Kernel: one program per (plane, kv head, request row).  It walks its row's pairs in chunks of
BLOCK_P: gather the chunk's source rows [BLOCK_P, D] into registers, barrier, scatter them.  The
barrier makes the gather-then-scatter safe inside a chunk (a pair's source may be an earlier pair's
destination); across chunks the ordering argument above holds.  Memory bound: 2 * pairs * Hkv * D
elements moved per plane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


@dataclass
class PlaneTable:
    """Device pointer table over same-shaped cache planes.

    Attributes:
        planes: the N plane tensors, each [num_blocks, block_size, Hkv, D].
        ptrs: [N] int64 data pointers on the planes' device.
    """
    planes: list
    ptrs: torch.Tensor

    @property
    def shape(self):
        return self.planes[0].shape


def vllm_planes(kv_caches: Sequence[torch.Tensor]) -> list:
    """vLLM 0.32 FLASH_ATTN layer caches -> the 2 L K/V planes.

    Each layer cache is vLLM's logical [num_blocks, Hkv, block_size, 2 * D] view (any stride order
    of ``KVCacheLayout``); K and V are split out exactly as FlashAttention reads them.
    """
    return [p for kv in kv_caches for p in kv.transpose(1, 2).split(kv.shape[-1] // 2, dim=-1)]


def plane_table(caches: Union[Sequence[torch.Tensor], torch.Tensor, PlaneTable]) -> PlaneTable:
    """Validate ``caches`` (see module docstring) and build its pointer table."""
    if isinstance(caches, PlaneTable):
        return caches
    planes = list(caches.unbind(0)) if isinstance(caches, torch.Tensor) else list(caches)
    if not planes:
        raise ValueError("falcon-vllm: kv_compaction: no cache planes given")
    p0 = planes[0]
    if p0.dim() != 4 or p0.stride(-1) != 1:
        raise ValueError("falcon-vllm: kv_compaction: planes must be [num_blocks, block_size, Hkv, D] with a "
                         f"contiguous last dim, got shape {tuple(p0.shape)} strides {p0.stride()}")
    for p in planes[1:]:
        if p.shape != p0.shape or p.stride() != p0.stride() or p.dtype != p0.dtype or p.device != p0.device:
            raise ValueError("falcon-vllm: kv_compaction: all planes need the same shape, strides, dtype and device")
    ptrs = torch.tensor([p.data_ptr() for p in planes], dtype=torch.int64, device=p0.device)
    return PlaneTable(planes, ptrs)


def _rows(src: torch.Tensor, dst: torch.Tensor, counts: Optional[torch.Tensor]):
    """Normalise to [B, A] pairs and [B] counts (None for the 1-D form)."""
    if src.shape != dst.shape or src.dim() not in (1, 2):
        raise ValueError(f"falcon-vllm: kv_compaction: src {tuple(src.shape)} and dst {tuple(dst.shape)} must both "
                         "be [N] or [B, A]")
    if src.dim() == 1:
        if counts is not None:
            raise ValueError("falcon-vllm: kv_compaction: counts go with [B, A] src/dst, not [N]")
        return src.view(1, -1), dst.view(1, -1), None
    if counts is None or counts.shape != (src.shape[0],):
        raise ValueError("falcon-vllm: kv_compaction: [B, A] src/dst need counts [B]")
    return src, dst, counts


def kv_compaction_ref(caches, src: torch.Tensor, dst: torch.Tensor,
                      counts: Optional[torch.Tensor] = None) -> None:
    """Plain-torch compaction, in place (the CPU path and the kernel's oracle).

    Args:
        caches: planes as a list of [num_blocks, block_size, Hkv, D] tensors, a stacked
            [N, num_blocks, block_size, Hkv, D] tensor, or a :class:`PlaneTable`.
        src, dst: int flat slots, [N] or [B, A] (then with ``counts`` [B]).
        counts: [B] number of valid pairs per row of a 2-D src/dst.

    Every plane gets ``slot[dst] <- slot[src]`` as gather-then-scatter (equal to in-order copying
    under the module's ordering requirement).  One host sync when ``counts`` is given.
    """
    src, dst, counts = _rows(src, dst, counts)
    if counts is not None:
        keep = torch.arange(src.shape[1], device=src.device)[None, :] < counts.to(src.device)[:, None]
        src, dst = src[keep], dst[keep]
    src, dst = src.reshape(-1).long(), dst.reshape(-1).long()
    move = src != dst
    src, dst = src[move], dst[move]
    stacked = isinstance(caches, torch.Tensor)
    planes = [caches] if stacked else (caches.planes if isinstance(caches, PlaneTable) else list(caches))
    bs = planes[0].shape[-3]
    sb, so, db, do = src // bs, src % bs, dst // bs, dst % bs
    for p in planes:
        if stacked:
            p[:, db, do] = p[:, sb, so]          # [N, pairs, Hkv, D]; the read is a copy
        else:
            p[db, do] = p[sb, so]                # [pairs, Hkv, D]


_BITS_DTYPE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}

if triton is not None:
    @triton.jit
    def _kv_compact_kernel(PTRS, SRC, DST, CNT, A, s_row, s_blk, s_slot, s_head,
                           PAGE: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
                           BLOCK_P: tl.constexpr, HAS_COUNTS: tl.constexpr, ELEM: tl.constexpr):
        plane = tl.program_id(0)
        head = tl.program_id(1)
        b = tl.program_id(2)
        base = tl.load(PTRS + plane).to(tl.pointer_type(ELEM)) + head * s_head
        n = A
        if HAS_COUNTS:
            n = tl.minimum(tl.load(CNT + b), A)
        d = tl.arange(0, D_P2)
        d_ok = d < D
        for a0 in range(0, n, BLOCK_P):
            a = a0 + tl.arange(0, BLOCK_P)
            ok = a < n
            s = tl.load(SRC + b * s_row + a, mask=ok, other=0).to(tl.int64)
            t = tl.load(DST + b * s_row + a, mask=ok, other=0).to(tl.int64)
            ok = ok & (s != t)
            s_off = (s // PAGE) * s_blk + (s % PAGE) * s_slot
            t_off = (t // PAGE) * s_blk + (t % PAGE) * s_slot
            m = ok[:, None] & d_ok[None, :]
            x = tl.load(base + s_off[:, None] + d[None, :], mask=m)      # [BLOCK_P, D_P2]
            tl.debug_barrier()   # every source of the chunk is read before any write
            tl.store(base + t_off[:, None] + d[None, :], x, mask=m)


def kv_compaction(caches, src: torch.Tensor, dst: torch.Tensor,
                  counts: Optional[torch.Tensor] = None, block_p: int = 32) -> None:
    """Triton compaction, in place, all planes (layers x K/V) in one launch.

    Same arguments and result as :func:`kv_compaction_ref`; ``src``/``dst``/``counts`` must be
    contiguous and on the caches' device.  No host sync.  Grid: (planes, Hkv, B).
    """
    if triton is None:
        raise RuntimeError("falcon-vllm: triton is not installed; use kv_compaction_ref")
    table = plane_table(caches)
    src, dst, counts = _rows(src, dst, counts)
    src, dst = src.contiguous(), dst.contiguous()
    B, A = src.shape
    if A == 0 or B == 0:
        return
    p0 = table.planes[0]
    nb, bs, H, D = p0.shape
    elem = getattr(tl, _BITS_DTYPE[p0.element_size()])
    _kv_compact_kernel[(len(table.planes), H, B)](
        table.ptrs, src, dst, counts if counts is not None else src, A, src.stride(0),
        p0.stride(0), p0.stride(1), p0.stride(2),
        PAGE=bs, D=D, D_P2=triton.next_power_of_2(D), BLOCK_P=block_p,
        HAS_COUNTS=counts is not None, ELEM=elem)
