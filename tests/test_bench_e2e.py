"""The end-to-end benchmark harness runs on a tiny model and writes valid results."""

import json
import os
import sys

from tests.vllm_util import save_target

from falcon_vllm.testing import random_drafter, tiny_llama

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_e2e  # noqa: E402

FIELDS = {"method", "dataset", "model", "drafter", "batch_size", "temperature", "num_prompts", "generated_tokens",
          "tau", "tau_excl_bonus", "alpha", "tokens_per_s", "speedup_vs_vanilla", "greedy_identical", "command",
          "machine"}


def test_metric_delta_uses_counters():
    before = {"drafts": 10, "draft_tokens": 40, "accepted": 12, "per_pos": [6, 4, 2, 0]}
    after = {"drafts": 30, "draft_tokens": 120, "accepted": 52, "per_pos": [20, 14, 10, 8]}
    m = bench_e2e.metric_delta(before, after, generated=60)
    assert m["tau"] == 1 + 40 / 20 and m["tau_excl_bonus"] == 2.0 and m["alpha"] == 40 / 60
    assert m["per_position_acceptance"] == [14 / 20, 10 / 20, 8 / 20, 8 / 20]


def test_harness_end_to_end(tmp_path):
    t = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=1, seed=2)
    model = save_target(t, str(tmp_path / "tiny"))
    random_drafter(t, k=2).save_pretrained(str(tmp_path / "drafter"))
    bench_e2e.main(["--model", model, "--drafter", str(tmp_path / "drafter"), "--methods",
                    "vanilla,falcon-chain,ngram,ref-vanilla,ref-falcon-chain", "--datasets", "humaneval",
                    "--num-prompts", "1", "--max-new-tokens", "12", "--max-model-len", "1024",
                    "--out-dir", str(tmp_path / "res"), "--name", "tiny"])
    rows = json.loads((tmp_path / "res" / "tiny.json").read_text())
    assert [r["method"] for r in rows] == ["vanilla", "falcon-chain", "ngram", "ref-vanilla", "ref-falcon-chain"]
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["generated_tokens"] == 12 and r["tokens_per_s"] > 0
    falcon = rows[1]
    assert falcon["greedy_identical"] is True and falcon["speedup_vs_vanilla"] > 0 and falcon["tau"] >= 1.0
    assert rows[4]["greedy_identical"] is True        # reference engine vs transformers generate
    assert (tmp_path / "res" / "tiny.md").read_text().count("|") > 20
