"""tune-tree's verify cost measured inside vLLM: every (batch size, width) timed as one engine step that computed
exactly B x W tokens over the cached prefix, and tune-tree fitting its trees from that table."""

import argparse
import json
import math

import pytest

pytest.importorskip("vllm")

from tests.vllm_util import save_target  # noqa: E402  (sets the in-process engine's environment)

from falcon_vllm.testing import random_drafter, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("verify_cost")
    target = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=1, seed=5, qwen2=True, tied=True)
    save_target(target, str(base / "target"))
    random_drafter(target, k=2, fusion="fc", seed=2).save_pretrained(str(base / "drafter"))
    return base


def test_every_shape_is_one_step_of_b_times_w_tokens(ckpt):
    from falcon_vllm.vllm.verify_cost import measure

    costs = measure(str(ckpt / "target"), [1, 3], [4, 2], prefix=40, repeats=1)  # 40 -> whole blocks
    assert set(costs) == {(b, w) for b in (1, 3) for w in (1, 2, 4)}  # W = 1 (a decode step) always measured
    assert all(math.isfinite(t) and t > 0 for t in costs.values())


def test_a_missed_prefix_cache_is_refused(ckpt, monkeypatch):
    """A step that computes more than B x W tokens (here: the prefix cache switched off) would time the wrong
    work: measure stops with the reason."""
    import vllm

    from falcon_vllm.vllm import verify_cost

    real = vllm.LLM
    monkeypatch.setattr(vllm, "LLM", lambda **kw: real(**{**kw, "enable_prefix_caching": False}))
    with pytest.raises(RuntimeError, match=r"computed \d+ tokens, not one step of 1 x 1"):
        verify_cost.measure(str(ckpt / "target"), [1], [1], prefix=32, repeats=0)


def test_tune_tree_fits_from_the_vllm_cost_table(ckpt, tmp_path):
    from falcon_vllm import tune_tree

    p = argparse.ArgumentParser()
    tune_tree.add_arguments(p)
    out = tmp_path / "tree.json"
    args = p.parse_args(["--target", str(ckpt / "target"), "--drafter", str(ckpt / "drafter"), "--out", str(out),
                         "--num-prompts", "1", "--gen-tokens", "12", "--max-depth", "3", "--topk", "2",
                         "--batch-sizes", "1,2", "--widths", "2,4"])
    assert args.cost == "vllm"  # the default
    assert tune_tree.main(args) == 0
    res = json.loads(out.read_text())
    assert res["cost_model"] == "vllm"
    assert set(res["costs_s"]) == {f"{b}x{w}" for b in (1, 2) for w in (1, 3, 5)}  # 1 + W rows per request
    assert set(res["by_batch_size"]) == {"1", "2"}
    assert res["drafter"] == "drafter"  # names, not machine paths: the file may ship as a drafter's serving.json


def test_the_benchmark_writes_both_columns(ckpt, tmp_path):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import verify_cost as bench

    assert bench.main(["--target", str(ckpt / "target"), "--batch-sizes", "2", "--widths", "3", "--prefix", "32",
                       "--name", "vc", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "vc.json").read_text())["rows"]
    assert [(r["batch_size"], r["width"]) for r in rows] == [(2, 1), (2, 3)]
    assert rows[0]["vllm_vs_1"] == 1.0 and rows[0]["transformers_vs_1"] == 1.0
    assert rows[1]["vllm_ms"] > 0 and rows[1]["transformers_ms"] > 0
