"""benchmarks/train_speed.py: times the real trainer's steps on synthetic recipe-shaped data (tiny target here)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, BENCH)
import train_speed  # noqa: E402


def check(r: dict, steps: int, warmup: int, batch: int = 8):
    assert r["timed_steps"] == steps == len(r["step_s"]) and r["warmup_steps"] == warmup
    assert r["final"]["steps"] == steps + warmup == len(r["losses"])  # the trainer ran exactly warm-up + timed
    assert all(t > 0 for t in r["step_s"]) and r["s_per_step"] > 0 and r["s_in_train_step"] > 0
    assert r["s_in_train_step"] <= r["s_per_step"] * (1 + 1e-6)  # the interval holds the step and the batch
    assert min(r["step_s"]) == r["s_per_step_min"] and r["steps_per_s"] == pytest.approx(1 / r["s_per_step"], 1e-2)
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["conversations_per_s"] == pytest.approx(batch / r["s_per_step"], rel=1e-2)
    assert r["positions_per_s"] > r["answer_tokens_per_s"] > 0
    assert r["epoch_ends_in_timed_steps"] == 0  # default conversations: all steps in one epoch
    assert r["train_conversations"] >= (steps + warmup) * batch
    assert all(v >= 0 for v in r["setup_s"].values()) and r["setup_s"]["teacher_cache"] > 0
    assert r["torch"] == torch.__version__ and r["threads"] >= 1 and r["device_name"]


def test_tiny_cpu_falcon_run_writes_json_and_markdown(tmp_path):
    # Its own process: an in-process vLLM CPU engine (other test files start one) replaces torch.set_num_threads
    # with a no-op for the rest of the process, and this run checks that --threads is honoured.
    out = tmp_path / "ts.json"
    subprocess.run([sys.executable, os.path.join(BENCH, "train_speed.py"), "--tiny", "--steps", "3", "--warmup", "1",
                    "--threads", "2", "--out", str(out)], check=True, timeout=600)
    r = json.loads(out.read_text())
    check(r, 3, 1)
    assert r["device"] == "cpu" and r["peak_gpu_mem_gib"] is None and r["threads"] == 2
    assert r["mode"] == "falcon" and r["vocab"] == 512 and r["draft_vocab"] == 256
    assert r["command"].endswith(f"--out {out}")
    md = (tmp_path / "ts.md").read_text()
    assert "| s/step (mean, median, min) |" in md and f"{r['s_per_step']:.4f}" in md


def test_tiny_cpu_eagle_run(tmp_path):
    out = tmp_path / "ts.json"
    r = train_speed.main(["--tiny", "--mode", "eagle", "--steps", "2", "--warmup", "1", "--batch-size", "4",
                          "--logit-positions", "0", "--out", str(out)])
    check(r, 2, 1, batch=4)
    assert r["mode"] == "eagle" and len(r["final"]["top1_by_block_position"]) == 1  # k=1
    assert r["logit_positions"] == 0
    assert json.loads(out.read_text())["s_per_step"] == r["s_per_step"]  # the JSON holds what main returned


def test_importing_the_benchmark_and_trainer_needs_no_vllm():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import train_speed; "
            "from falcon_vllm.train import trainer; assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code, BENCH], check=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda_is_an_error():
    with pytest.raises(SystemExit, match="falcon-vllm: "):
        train_speed.main(["--tiny", "--device", "cuda", "--steps", "1", "--warmup", "1"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_cuda_bf16_run():
    r = train_speed.main(["--tiny", "--device", "cuda", "--bf16", "--steps", "3", "--warmup", "2"])
    check(r, 3, 2)
    assert r["bf16"] and r["peak_gpu_mem_gib"] > 0 and r["device_name"] == torch.cuda.get_device_name()
    assert r["final"]["device"] == "cuda"
