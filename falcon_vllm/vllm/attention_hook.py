"""The one attention hook tree mode computes through, and the start-up probe of the KV-cache layouts.

The ``forward`` of the attention backends' impls (CPU_ATTN; FLASH_ATTN where importable) is wrapped once
(:func:`install`); the wrapper serves whatever attention object :func:`falcon_vllm.core.paged_kv.tree_attention_scope`
made active (the target's tree rows, a drafter tree pass), and runs vLLM's kernel untouched outside a scope.
"""

from __future__ import annotations

import torch

from falcon_vllm.core.paged_kv import _ACTIVE, kv_layout, layer_kv_cache, paged_kv
from falcon_vllm.vllm import patches


def _make_forward(orig):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, *args, **kwargs):
        attention = _ACTIVE.get()
        if attention is None or not attention.wants(attn_metadata):
            return orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attention.alone:  # the tree path serves every row of this layer: the stock kernel is skipped
            attention.attend(self, layer, query, key, value, kv_cache, attn_metadata, output)
            return output
        result = orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        attention.attend(self, layer, query, key, value, kv_cache, attn_metadata, output)
        return result

    return forward


def install() -> None:
    """Wrap the ``forward`` of CPU_ATTN's and (where importable) FLASH_ATTN's impl (idempotent)."""
    for p in patches.PATCHES:
        if p.name == "forward":
            try:
                cls = patches.resolve(p.owner)
            except (ImportError, AttributeError):  # FLASH_ATTN on a CPU build
                continue
            patches.wrap(cls, "forward", _make_forward)


# ---------------------------------------------------------------------------- start-up layout probe
def probe_layout(name, layer, impl) -> bool:
    """Write known K/V through the backend's own ``do_kv_cache_update`` into a 2-block scratch cache
    with the layer's shape and strides, read them back with :func:`paged_kv` (a mismatch fails with
    :func:`patches.fail`).  False: the layer holds no KV cache (nothing probed)."""
    kv = layer_kv_cache(layer)
    if kv is None:
        return False
    _, hkv, bs, d2 = kv.shape
    order = sorted(range(4), key=lambda i: -kv.stride(i))          # the layer's stride order, outermost first
    shape = (2, hkv, bs, d2)
    scratch = torch.zeros([shape[i] for i in order], dtype=kv.dtype, device=kv.device)
    scratch = scratch.permute([order.index(i) for i in range(4)])  # logical [2, Hkv, bs, 2D], same strides
    n = 2 * bs
    g = torch.Generator(device="cpu").manual_seed(0)
    key, value = (torch.randn(n, hkv, d2 // 2, generator=g).to(kv.device, kv.dtype) for _ in range(2))
    slots = torch.arange(n, device=kv.device).flip(0)               # token t -> slot n-1-t
    if not callable(getattr(impl, "do_kv_cache_update", None)):
        patches.fail(f"{type(impl).__name__} has no do_kv_cache_update (the KV-cache writer tree mode checks its "
                     "layout with)")
    impl.do_kv_cache_update(layer, key, value, scratch, slots)
    try:
        kc, vc = paged_kv(scratch, kv_layout(impl, layer))
    except NotImplementedError:
        return True  # a backend tree mode does not serve: refused by tree mode's own start-up check
    s = slots.long()
    if not (torch.equal(kc[s // bs, s % bs], key) and torch.equal(vc[s // bs, s % bs], value)):
        patches.fail(f"{type(impl).__name__} (layer {name}) stores its KV cache in a byte layout tree mode does not "
                     "read")
    return True
