"""What tree mode's target side and drafter side share: paged KV-cache layouts, dense attention, and the scope of
the one attention hook both compute through.

Tree mode computes attention itself in two places: the target's tree rows
(:class:`falcon_vllm.vllm.tree_verify.VerifyTreeAttention`) and the drafter's SAR tree passes
(:class:`falcon_vllm.core.tree_draft.DraftTreeAttention`).  Both read vLLM's paged KV caches
(:func:`paged_kv`) and run inside the stock attention layers, whose backend ``forward`` is wrapped
once (:func:`falcon_vllm.vllm.attention_hook.install`).  The wrapper serves whatever attention object is active:
:func:`tree_attention_scope` makes one active for the duration of one forward pass (the target's
forward of a tree step, a drafter tree pass), as vLLM's own ``set_forward_context`` does for the
attention metadata; outside a scope every layer runs vLLM's kernel untouched.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch


# ---------------------------------------------------------------------------- host -> device
def to_device(tensors, device) -> list[torch.Tensor]:
    """Small host integer tensors (a step's indices, lengths, tree bits) on ``device``, in one copy.

    Each tensor keeps its dtype and shape.  On CUDA they travel as one buffer (their common dtype, else
    int64) from pinned memory, queued without waiting for the device (a copy from pageable memory is a host
    sync); elsewhere they are only moved."""
    device = torch.device(device)
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    dt = tensors[0].dtype if len({t.dtype for t in tensors}) == 1 else torch.int64
    flat = torch.cat([t.reshape(-1).to(dt) for t in tensors]).pin_memory().to(device, non_blocking=True)
    out, o = [], 0
    for t in tensors:
        out.append(flat[o:o + t.numel()].view(t.shape).to(t.dtype))
        o += t.numel()
    return out


# ---------------------------------------------------------------------------- paged KV layouts
def kv_layout(impl, layer=None) -> str:
    """The paged layout of a layer's KV cache: ``cpu`` (CPU_ATTN, vec ISAs) or ``flash`` (NHD)."""
    name = type(impl).__name__
    if name.startswith("CPUAttention"):
        isa = getattr(layer, "isa", "vec")
        if isa not in ("vec", "vec16"):
            raise NotImplementedError(f"falcon-vllm: tree mode: the CPU attention ISA {isa!r} packs its KV cache in a "
                                      "layout tree mode cannot read (supported: vec, vec16; use float32/float16)")
        return "cpu"
    if name.startswith("FlashAttention"):
        return "flash"
    raise NotImplementedError(f"falcon-vllm: tree mode: attention backend {name} is not supported "
                              "(supported: CPU_ATTN on CPU, FLASH_ATTN on CUDA)")


def paged_kv(kv_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's KV cache -> (key_cache, value_cache) as [num_blocks, block_size, Hkv, D] views.

    vLLM 0.32 gives every attention layer the logical view [num_blocks, Hkv, block_size, 2 * D]
    (``create_kv_cache_views``) with the strides of the resolved ``KVCacheLayout``.
    """
    if layout == "flash":
        # FLASH_ATTN: any stride order; K and V are read exactly as FlashAttentionImpl.forward does
        return tuple(kv_cache.transpose(1, 2).split(kv_cache.shape[-1] // 2, dim=-1))
    if layout == "cpu":
        # CPU_ATTN (vec ISAs): per (block, kv head) bs*D key values stored [D, bs] (transposed),
        # then bs*D values stored [bs, D]
        nb, hkv, bs, d2 = kv_cache.shape
        d = d2 // 2
        flat = kv_cache.view(nb, hkv, bs * d2)
        keys = flat[:, :, : bs * d].unflatten(2, (d, bs)).permute(0, 3, 1, 2)
        vals = flat[:, :, bs * d:].unflatten(2, (bs, d)).permute(0, 2, 1, 3)
        return keys, vals
    raise ValueError(f"falcon-vllm: tree mode: unknown KV layout {layout!r}")


def layer_kv_cache(layer) -> torch.Tensor | None:
    """An attention layer's KV-cache tensor (vLLM may hold it in a one-element list), None where it holds none."""
    kv = layer.kv_cache
    if isinstance(kv, (list, tuple)):
        kv = kv[0] if kv else None
    return kv if isinstance(kv, torch.Tensor) and kv.numel() else None


def copy_kv_slots(kv_cache: torch.Tensor, layout: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V of flat slots ``src`` into slots ``dst`` (all heads) of one layer's cache."""
    kc, vc = paged_kv(kv_cache, layout)
    bs = kc.shape[1]
    sb, so, db, do = src // bs, src % bs, dst // bs, dst % bs
    for c in (kc, vc):
        c[db, do] = c[sb, so]  # the right side is gathered before the write


def dense_attention(q, keys, values, mask, scale):
    """One batched attention call: q [B, Q, H, D], keys/values [B, L, Hkv, D], mask [B or 1, Q, L] bool."""
    H, hkv = q.shape[2], keys.shape[2]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), keys.float().transpose(1, 2), values.float().transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=H != hkv)
    return o.transpose(1, 2)                                                   # [B, Q, H, D]



# ---------------------------------------------------------------------------- the attention hook
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("falcon_tree_attention", default=None)


@contextlib.contextmanager
def tree_attention_scope(attention):
    """Within the block, the wrapped attention layers compute through ``attention`` (None: stock).

    ``attention.attend(impl, layer, q, k, v, kv_cache, attn_metadata, output)`` fills ``output`` and
    returns True when it served the layer alone (the stock kernel is skipped), False when the stock
    kernel must run first (the object then recomputes some rows of its output).
    """
    token = _ACTIVE.set(attention)
    try:
        yield attention
    finally:
        _ACTIVE.reset(token)
