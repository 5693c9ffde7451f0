"""The manifest of vLLM internals (falcon_vllm.vllm.patches): installed once, checked, and failing by name."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from falcon_vllm.vllm import attention_hook, patches, register  # noqa: E402


def test_every_patch_is_installed_once_and_keeps_vllms_original():
    register()
    patches.check_classes()
    for p in patches.PATCHES:
        try:
            obj = patches.resolve(p.owner)
        except (ImportError, AttributeError):
            assert p.optional, p
            continue
        current = getattr(obj, p.name)
        if p.name == "EagleProposer":
            from falcon_vllm.vllm.proposer import FalconProposer
            assert current is FalconProposer
            continue
        orig = getattr(current, "__func__", current).__falcon_original__
        assert callable(orig) and orig is not current
        assert not patches.wrap(obj, p.name, lambda f: f)  # a second install is refused


def test_wrap_keeps_the_method_kind():
    class C:
        def m(self, x):
            return x

        @staticmethod
        def s(x):
            return x

        @classmethod
        def c(cls, x):
            return (cls, x)

    plus = lambda orig: lambda *a: ("wrapped", orig(*a))  # noqa: E731
    assert all(patches.wrap(C, n, plus) for n in ("m", "s", "c"))
    assert not patches.wrap(C, "m", plus)
    assert C().m(1) == ("wrapped", 1) and C.s(2) == ("wrapped", 2) and C.c(3) == ("wrapped", (C, 3))
    assert patches.original(C, "s")(5) == 5


def test_a_changed_signature_or_field_fails_by_name(monkeypatch):
    register()
    from vllm.v1.spec_decode import metadata
    import vllm.v1.worker.gpu_model_runner as gmr

    monkeypatch.setattr(gmr.GPUModelRunner, "_sample", lambda self, logits: None)
    with pytest.raises(patches.VllmVersionError, match=r"GPUModelRunner\._sample takes \['self', 'logits'\]"):
        patches.check_classes()
    monkeypatch.undo()

    @dataclasses.dataclass
    class SpecDecodeMetadata:
        draft_token_ids: torch.Tensor

    monkeypatch.setattr(metadata, "SpecDecodeMetadata", SpecDecodeMetadata)
    with pytest.raises(patches.VllmVersionError, match=r"SpecDecodeMetadata lacks \['num_draft_tokens'\]"):
        patches.check_classes()


def _cpu_layer(bs=16, hkv=2, d=32):
    """A CPU_ATTN layer with a cache as vLLM allocates it (logical [blocks, Hkv, bs, 2D])."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl
    from vllm.v1.attention.backend import AttentionType

    impl = Impl.__new__(Impl)  # __init__ probes the machine's kernels; the probe needs only these fields
    impl.scale, impl.head_size, impl.num_kv_heads, impl.kv_cache_dtype = d ** -0.5, d, hkv, "auto"
    impl.attn_type, impl.sliding_window, impl.logits_soft_cap, impl.alibi_slopes = AttentionType.DECODER, None, None, None
    impl.kv_sharing_target_layer_name = None
    layer = SimpleNamespace(impl=impl, isa="vec16", _k_scale_float=1.0, _v_scale_float=1.0,
                            kv_cache=torch.zeros(4, hkv, bs, 2 * d))
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={"l0": layer}))


def test_start_up_probe_reads_back_what_the_backend_wrote(monkeypatch):
    cfg = _cpu_layer()
    patches.check_instances(None, cfg, probe=attention_hook.probe_layout)
    real = attention_hook.paged_kv
    monkeypatch.setattr(attention_hook, "paged_kv", lambda kv, layout: real(kv, layout)[::-1])  # K and V swapped
    with pytest.raises(patches.VllmVersionError, match="byte layout tree mode does not read"):
        patches.check_instances(None, cfg, probe=attention_hook.probe_layout)
    patches.check_instances(None, cfg)  # chain mode reads no KV cache: no probe
    del cfg.compilation_config.static_forward_context["l0"].impl.kv_cache_dtype
    with pytest.raises(patches.VllmVersionError, match=r"lacks \['kv_cache_dtype'\]"):
        patches.check_instances(None, cfg)
