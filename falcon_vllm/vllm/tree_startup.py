"""Tree mode's start-up checks: models and settings tree attention cannot serve exactly are refused."""

from __future__ import annotations

from falcon_vllm.core.paged_kv import kv_layout


def _unsupported(name: str, layer) -> str | None:
    """What tree attention cannot compute exactly for this attention layer (None: supported)."""
    impl = layer.impl
    sw, cap = getattr(impl, "sliding_window", None), getattr(impl, "logits_soft_cap", None)
    checks = (
        (sw not in (None, -1, (-1, -1)), f"sliding-window attention (window {sw})"),
        (cap not in (None, 0), f"attention logit soft-capping ({cap})"),
        (getattr(impl, "alibi_slopes", None) is not None, "ALiBi position biases"),
        (getattr(impl, "sinks", None) is not None, "attention sinks"),
        (getattr(impl, "kv_cache_dtype", "auto") != "auto", f"a {getattr(impl, 'kv_cache_dtype', '')} KV cache "
         "(kv_cache_dtype; tree mode reads unscaled K/V)"),
        (getattr(impl, "kv_sharing_target_layer_name", None) is not None, "cross-layer KV-cache sharing"),
        (str(getattr(getattr(impl, "attn_type", "decoder"), "value", getattr(impl, "attn_type", "decoder")))
         != "decoder", f"{getattr(impl, 'attn_type', '')} attention"),
    )
    for bad, what in checks:
        if bad:
            return what
    try:
        kv_layout(impl, layer)
    except NotImplementedError as e:
        return str(e).removeprefix("falcon-vllm: tree mode: ")
    d = getattr(impl, "head_size", None)
    if type(impl).__name__.startswith("FlashAttention") and d is not None and (d & (d - 1) or not 16 <= d <= 256):
        return f"head size {d} (the Triton tree-attention kernel takes powers of two in [16, 256])"
    return None


def check_startup(vllm_config, kv_cache_config, draft_layer_names) -> None:
    """Refuse, before serving, any model or setting tree mode cannot serve exactly (one error naming it).

    Called once the KV cache and the attention backends exist (the proposer's
    ``initialize_attn_backend``).  Chain mode (vLLM's own EAGLE path) has none of these limits.
    """
    draft = set(draft_layer_names or ())
    ctx = vllm_config.compilation_config.static_forward_context
    hint = ("; tree mode refuses it at start-up rather than return something other than vanilla vLLM would. "
            "Serve this model in chain mode (a chain tree such as \"chain-4\", or no \"tree\" key)")
    for name, layer in ctx.items():
        if getattr(layer, "impl", None) is None or not hasattr(layer, "kv_cache"):
            continue
        what = _unsupported(name, layer)
        if what is not None:
            raise ValueError(f"falcon-vllm: tree mode does not support {what} (layer {name}){hint}")
    gid = {n: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for n in group.layer_names}
    target = {gid[n] for n in gid if n not in draft}
    if target != {0}:
        raise ValueError(f"falcon-vllm: tree mode does not support a target whose KV cache spans several KV-cache "
                         f"groups ({len(kv_cache_config.kv_cache_groups)} groups: hybrid or multi-spec models; "
                         f"target layers in groups {sorted(target)}){hint}")
