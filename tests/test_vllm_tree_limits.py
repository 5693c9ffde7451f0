"""What tree mode refuses at start-up, and what it does with requests it cannot draft for exactly.

Start-up: every attention feature tree attention lacks (sliding window, soft-cap, ALiBi, sinks,
quantised KV, KV sharing, other backends or CPU ISAs, kernel head sizes, several KV-cache groups)
is one ``falcon-vllm:`` error naming the setting, raised while the engine starts (CPU, in-process).
"""

import pytest
import torch



def _fa(**kw):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    a = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None, sliding_window=None,
             kv_cache_dtype="auto")
    a.update(kw)
    return FlashAttentionImpl(**a)


class _Layer:
    def __init__(self, impl):
        self.impl, self.kv_cache = impl, torch.zeros(1)


@pytest.mark.parametrize("setting,match", [
    ({}, None),
    ({"sliding_window": 64}, "sliding-window attention"),
    ({"logits_soft_cap": 30.0}, "soft-capping"),
    ({"alibi_slopes": [0.5] * 4}, "ALiBi"),
    ({"sinks": torch.zeros(4)}, "attention sinks"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "fp8_e4m3 KV cache"),
    ({"kv_sharing_target_layer_name": "l0"}, "KV-cache sharing"),
    ({"head_size": 80}, "head size 80"),
])
def test_flash_attention_features_are_refused(setting, match):
    """vLLM's own FlashAttentionImpl (constructed on CPU) with each setting; fields its CUDA-only
    constructor rejects here (sinks, fp8) are set on the built impl as __init__ stores them."""
    from falcon_vllm.vllm.tree_mode import _unsupported

    late = {k: setting[k] for k in ("sinks", "kv_cache_dtype") if k in setting}
    impl = _fa(**{k: v for k, v in setting.items() if k not in late})
    for k, v in late.items():
        setattr(impl, k, v)
    what = _unsupported("l0", _Layer(impl))
    assert (what is None) if match is None else (match in what), what


def test_other_backends_and_groups_are_refused():
    from falcon_vllm.vllm.tree_mode import _unsupported, check_startup

    class TritonAttentionImpl:
        pass

    assert "TritonAttentionImpl is not supported" in _unsupported("l0", _Layer(TritonAttentionImpl()))

    class Group:
        def __init__(self, names):
            self.layer_names = names

    class Cfg:
        kv_cache_groups = [Group(["t0", "d0"]), Group(["t1"])]

    class VC:
        class compilation_config:
            static_forward_context = {}

    with pytest.raises(ValueError, match="^falcon-vllm: tree mode does not support a target whose KV cache spans"):
        check_startup(VC, Cfg, ["d0"])
    Cfg.kv_cache_groups = [Group(["t0", "t1"]), Group(["d0"])]  # the drafter's own group is fine
    check_startup(VC, Cfg, ["d0"])
