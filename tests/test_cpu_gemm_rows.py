"""benchmarks/cpu_gemm_rows.py: the projections it sweeps and the GEMM it times (vLLM's CPU dispatch)."""

import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import cpu_gemm_rows  # noqa: E402


def test_linear_shapes_of_a_llama_target():
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_hidden_layers=3, vocab_size=500)
    shapes = cpu_gemm_rows.linear_shapes(cfg)
    assert shapes[:4] == [(128, 64), (64, 64), (192, 64), (64, 96)]  # qkv (4+2*2 heads x 16), o, gate_up, down
    assert len(shapes) == 3 * 4 + 1 and shapes[-1] == (500, 64)


def test_the_timed_gemm_is_vllms_and_computes_the_linear():
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(48, 32), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), x @ layer.weight.T, rtol=1e-4, atol=1e-4)
    best = cpu_gemm_rows.measure([(48, 32), (32, 48)], rows=[1, 3], rounds=1, iters=1)
    assert set(best) == {1, 3} and all(ms > 0 for ms in best.values())
    assert "CPUs" in cpu_gemm_rows.cpu_name()


def test_draft_gemm_dtypes_times_the_plugins_matmul_paths():
    """benchmarks/draft_gemm_dtypes.py: a drafter pass's linear layers from its config (fc fusion, each layer's
    four projections, the truncated head), and each dtype's path computes x @ W.T (bf16 and int8 within their
    rounding)."""
    import json

    import draft_gemm_dtypes as dg
    from harness.paths import DEFAULT_DRAFTER

    with open(os.path.join(DEFAULT_DRAFTER, "config.json")) as f:
        cfg = json.load(f)
    shapes = dg.drafter_shapes(cfg)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    assert shapes[0] == (h, 2 * h) and shapes[-1] == (cfg["draft_vocab_size"], h)
    assert len(shapes) == 2 + 4 * layers and shapes[1] == (960, 576)  # SmolLM2: (9 + 2 * 3) heads x 64
    torch.manual_seed(0)
    w, x = torch.randn(96, 64) * 0.05, torch.randn(3, 64)
    ref = x @ w.T
    # int8 within 2%: with int8 dot-product units (VNNI), where ``draft_gemm_dtype`` auto picks it; without them
    # oneDNN's u8 x s8 pairs saturate (measured 8% on such a CPU), and auto never picks int8 there
    int8_tol = 2e-2 if torch.cpu._is_vnni_supported() else 0.15
    for dtype, tol in (("fp32", 1e-5), ("bf16", 1e-2), ("int8", int8_tol)):
        out = dg.linear_fn(w, dtype)(x)
        assert out.dtype == torch.float32 and ((out - ref).norm() / ref.norm()).item() < tol, dtype
    best = dg.measure([(48, 32), (32, 48)], rows=[1, 2], copies=2, rounds=1)
    assert set(best) == {(d, m) for d in dg.DTYPES for m in (1, 2)} and all(ms > 0 for ms in best.values())
