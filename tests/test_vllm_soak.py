"""Short soak of `falcon-vllm serve` in tree mode (benchmarks/soak_server.py is the long one): 32
concurrent clients for 30 s on a tiny random target, streaming and not, aborts and malformed
requests; greedy answers equal a vanilla server's, memory flat, spec counters consistent."""

import json

import pytest

from tests.vllm_util import save_target

from falcon_vllm.soak import markdown, soak
from falcon_vllm.testing import random_drafter, tiny_llama


@pytest.mark.slow
def test_short_soak_tree_mode(tmp_path):
    t = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=1, seed=3)
    target = save_target(t, str(tmp_path / "target"))
    random_drafter(t, k=2).save_pretrained(str(tmp_path / "drafter"))
    spec = {"method": "falcon", "model": str(tmp_path / "drafter"), "tree": "tree-3x2x1"}
    res = soak(target, ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager"],
               ["--speculative-config", json.dumps(spec)], str(tmp_path), clients=32, duration=30.0,
               max_words=100, max_rss_growth=0.15)
    assert not res["failures"], markdown(res)
    assert res["completed"] > 32 and res["aborted"] > 0 and res["malformed"] > 0 and res["greedy_prompts_checked"] > 5
