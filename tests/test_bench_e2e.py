"""benchmarks/studies/bench_e2e.py (separate engines, one after another): counter-based metrics, and a full run on
a tiny model."""

import importlib.util
import json
import os
import sys

import pytest

from tests.vllm_util import save_target

from falcon_vllm.testing import random_drafter, tiny_llama

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from studies import bench_e2e  # noqa: E402

FIELDS = {"method", "dataset", "model", "drafter", "batch_size", "temperature", "num_prompts", "generated_tokens",
          "tau", "tau_excl_bonus", "alpha", "tokens_per_s", "speedup_vs_vanilla", "greedy_identical", "command",
          "machine", "engine", "tokens_per_s_std", "tokens_per_s_min", "tokens_per_s_max", "repeats",
          "per_position_acceptance"}


def test_metrics_come_from_counter_deltas():
    before = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 12,
              "num_accepted_tokens_per_pos": [6, 4, 2, 0]}
    after = {"num_drafts": 30, "num_draft_tokens": 120, "num_accepted_tokens": 52,
             "num_accepted_tokens_per_pos": [20, 14, 10, 8]}
    m = bench_e2e.metrics_from_counters(before, after, generated=60)
    assert m["tau"] == 1 + 40 / 20 and m["tau_excl_bonus"] == 40 / 20
    assert m["alpha"] == 40 / 60 and m["draft_acceptance_rate"] == 40 / 80
    assert m["per_position_acceptance"] == [14 / 20, 10 / 20, 8 / 20, 8 / 20]
    assert (m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]) == (20, 80, 40)
    # the per-position vector may appear only after the first draft
    m = bench_e2e.metrics_from_counters(bench_e2e.empty_counters(), after, generated=104)
    assert m["tau"] == 1 + 52 / 30 and m["alpha"] == 52 / 104
    # no drafts (vanilla): tau 1, nothing accepted
    z = bench_e2e.metrics_from_counters(before, before, generated=50)
    assert z["tau"] == 1.0 and z["tau_excl_bonus"] == 0.0 and z["alpha"] == 0.0 and z["per_position_acceptance"] == []
    with pytest.raises(ValueError):
        bench_e2e.metrics_from_counters(after, before, generated=1)


def test_reference_rounds_become_counters():
    c = bench_e2e.empty_counters()
    bench_e2e.add_rounds(c, accepted=[0, 3, 1], nodes=[5, 5, 5], depth=3)
    assert c == {"num_drafts": 3, "num_draft_tokens": 15, "num_accepted_tokens": 4,
                 "num_accepted_tokens_per_pos": [2, 1, 1]}
    m = bench_e2e.metrics_from_counters(bench_e2e.empty_counters(), c, generated=7)
    assert m["tau"] == 1 + 4 / 3 and m["alpha"] == 4 / 7


def test_harness_end_to_end(tmp_path, monkeypatch):
    # the draft-model baseline needs the Qwen2.5-Coder pair; whether this machine has converted it
    # must not change what the test exercises (the skip path), so it is reported missing here
    real_model_dir = bench_e2e.model_dir

    def model_dir(name):
        if name in (bench_e2e.DRAFT_MODEL_TARGET, bench_e2e.DRAFT_MODEL_DRAFT):
            raise bench_e2e.Skip(f"model {name!r} is not available (test)")
        return real_model_dir(name)

    monkeypatch.setattr(bench_e2e, "model_dir", model_dir)
    t = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=1, seed=2)
    model = save_target(t, str(tmp_path / "tiny"))
    random_drafter(t, k=2).save_pretrained(str(tmp_path / "drafter"))
    plugin = importlib.util.find_spec("falcon_vllm.vllm") is not None
    methods = ["vanilla", "ngram", "ref-vanilla", "ref-falcon-chain", "eagle", "draft-model"]
    if plugin:
        methods[1:1] = ["falcon-chain", "falcon-tree:tree-2x2"]
    bench_e2e.main(["--model", model, "--drafter", str(tmp_path / "drafter"), "--eagle-drafter",
                    str(tmp_path / "no-eagle"), "--methods", ",".join(methods), "--datasets", "humaneval",
                    "--num-prompts", "1", "--max-new-tokens", "12", "--max-model-len", "1024", "--repeats", "2",
                    "--out-dir", str(tmp_path / "res"), "--name", "tiny"])
    doc = json.loads((tmp_path / "res" / "tiny.json").read_text())
    rows = doc["rows"]
    got = [r["method"] for r in rows]
    assert got == (["ref-vanilla", "ref-falcon-chain", "vanilla"] +
                   (["falcon-chain", "falcon-tree:tree-2x2"] if plugin else []) + ["ngram"])
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert set(bench_e2e.ROW_FIELDS) <= set(r)
        assert r["generated_tokens"] > 0 and r["tokens_per_s"] > 0 and r["repeats"] == 2
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert r["greedy_identical"] is True and r["deterministic_across_repeats"] is True
        assert r["speedup_vs_vanilla"] > 0 and r["tau"] >= 1.0 and 0 <= r["alpha"] <= 1
        assert r["engine"] == ("reference" if r["method"].startswith("ref-") else "vllm")
        assert r["command"].startswith("benchmarks/studies/bench_e2e.py --model")
    by = {r["method"]: r for r in rows}
    assert by["ref-falcon-chain"]["num_drafts"] > 0 and by["ref-falcon-chain"]["tree"] == "chain-4"
    if plugin:
        f = by["falcon-chain"]
        assert f["num_drafts"] > 0 and f["num_draft_tokens"] == 4 * f["num_drafts"]
        t = by["falcon-tree:tree-2x2"]  # 2 + 4 nodes, verified as one tree per step
        assert t["tree"] == "tree-2x2" and t["num_spec_tokens"] == 6 and t["num_draft_tokens"] == 6 * t["num_drafts"]
    skipped = {s["method"]: s["reason"] for s in doc["skipped"]}
    assert "no-eagle" in skipped["eagle"] and "draft-model" in skipped
    md = (tmp_path / "res" / "tiny.md").read_text()
    assert md.count("\n| ") == len(rows) + 1 and "Skipped methods" in md
    for png in ("tiny_speedup.png", "tiny_accept.png"):
        assert (tmp_path / "res" / png).stat().st_size > 1000
    if not plugin:
        pytest.skip("falcon-chain part skipped: the falcon vLLM plugin (falcon_vllm.vllm) is not installed")


def test_help_lists_methods(capsys):
    with pytest.raises(SystemExit) as e:
        bench_e2e.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for m in ("falcon-chain", "falcon-tree", "eagle", "ngram", "draft-model", "ref-falcon-tree", "--repeats", "--warmup"):
        assert m in out
