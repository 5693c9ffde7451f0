"""Tree mode's compaction: the accepted path's target K/V and per-token buffers moved next to the root.

After the tree sampler, the accepted nodes' K/V are copied into the slots right after the root, and the
runner's per-token buffers (input ids, positions, target hidden states) are reordered the same way, so vLLM
sees a chain step that accepted ``a`` tokens (:mod:`falcon_vllm.vllm.tree_verify`, step 5).
"""

from __future__ import annotations

import torch

from falcon_vllm.core.paged_kv import copy_kv_slots, kv_layout, layer_kv_cache, paged_kv
from falcon_vllm.core.tree_draft import TreeState


def _target_kv_caches(runner) -> list[tuple[torch.Tensor, str]]:
    """The V1 runner's target KV caches (:func:`target_kv_caches`)."""
    return target_kv_caches(runner.vllm_config, getattr(runner.drafter, "_draft_attn_layer_names", ()))


def target_kv_caches(vllm_config, draft_layer_names) -> list[tuple[torch.Tensor, str]]:
    """The target's attention layers' KV caches and layouts (the drafter's layers, ``draft_layer_names``, left out);
    any runner."""
    ctx = vllm_config.compilation_config.static_forward_context
    draft = set(draft_layer_names or ())
    out = []
    for name, layer in ctx.items():
        if name in draft or not hasattr(layer, "kv_cache") or not hasattr(layer, "impl"):
            continue
        kv = layer_kv_cache(layer)
        if kv is not None:
            out.append((kv, kv_layout(layer.impl, layer)))
    return out


def compact(runner, state: TreeState, step, paths: dict[int, list[int]]) -> None:
    """Move the accepted nodes' K/V and per-token buffers next to the root (path order); ``step`` is the
    step's :class:`falcon_vllm.vllm.tree_verify.TreeStep`, ``paths`` each tree request's accepted node slots."""
    src, dst = [], []
    for r, path in paths.items():
        root = int(step.root_rows[r])
        for i, s in enumerate(path):
            if s != i + 1:  # already in place otherwise (decided on the host: no device sync)
                src.append(root + s)
                dst.append(root + 1 + i)
    if not src:
        return
    dev = runner.positions.device
    src_t = torch.tensor(src, dtype=torch.long, device=dev)
    dst_t = torch.tensor(dst, dtype=torch.long, device=dev)
    slots_src = step.slot_mapping[src_t].long()
    slots_dst = step.slot_mapping[dst_t].long()
    compact_kv(_target_kv_caches(runner), slots_src, slots_dst, state=state)
    ids = runner.input_ids.gpu
    ids[dst_t] = ids[src_t]
    runner.positions[dst_t] = runner.positions[src_t]
    hidden = state.hidden_states
    if hidden is not None:
        hidden[dst_t] = hidden[src_t]


def _use_compaction_kernel(kvs) -> bool:
    """The one-launch Triton compaction serves CUDA caches in the FLASH_ATTN layout."""
    if not kvs or not all(kv.is_cuda and layout == "flash" for kv, layout in kvs):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compact_kv(kvs: list[tuple[torch.Tensor, str]], src: torch.Tensor, dst: torch.Tensor,
               state: TreeState | None = None, kernel: bool | None = None) -> None:
    """Copy flat slots ``src`` -> ``dst`` in every layer's K and V (dst <= src, dst increasing per request).

    On CUDA (FLASH_ATTN layout) one launch of ``kernels/kv_compaction.py`` moves all layers; elsewhere
    two index copies per layer.  ``kernel`` overrides the choice (tests run the Triton kernel under
    ``TRITON_INTERPRET=1`` on CPU tensors); ``state`` keeps the kernel's plane pointer table.
    """
    if not (_use_compaction_kernel(kvs) if kernel is None else kernel):
        for kv, layout in kvs:
            copy_kv_slots(kv, layout, src, dst)
        return
    from falcon_vllm.kernels.kv_compaction import kv_compaction, plane_table

    key = tuple(kv.data_ptr() for kv, _ in kvs)
    table = None if state is None else state.plane_table
    if table is None or table[0] != key:  # cache tensors do not move: built once
        table = (key, plane_table([p for kv, layout in kvs for p in paged_kv(kv, layout)]))
        if state is not None:
            state.plane_table = table
    kv_compaction(table[1], src.contiguous(), dst.contiguous())
