"""benchmarks/ab_step.py and `falcon-vllm bench` (which runs it): the options it refuses before any engine starts,
the help a user reads, and a whole same-run A/B of vanilla against falcon on a tiny model."""

import json
import os
import sys

import pytest

from falcon_vllm import bench_cli
from falcon_vllm.testing import random_drafter, tiny_llama

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
_env = dict(os.environ)
import ab_step  # noqa: E402

for _k in set(os.environ) - set(_env):  # the benchmark's environment defaults stay out of the other tests
    del os.environ[_k]


@pytest.mark.parametrize("argv, error", [
    (["--configs", "vanilla"], "--configs needs a baseline and at least one configuration to compare"),
    (["--turn", "-1"], "--turn takes a turn number"),
    (["--temperature", "0.7", "--stop-at-eos"], "--stop-at-eos with --temperature"),
    (["--top-p", "0"], "--temperature must be >= 0 and --top-p in (0, 1]"),
])
def test_bad_options_stop_before_any_engine(argv, error):
    with pytest.raises(SystemExit) as e:
        ab_step.main(argv)
    assert str(e.value).startswith(f"falcon-vllm: {error}")


def test_bench_help_says_what_it_measures(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as e:
        bench_cli.cli(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: falcon-vllm bench")
    assert "speedup of Falcon against vanilla vLLM" in out and "(default: vanilla,falcon)" in out
    assert "(default: bench)" in out and "--compile" in out and "--out-dir" in out


def test_bench_outside_a_checkout_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "BENCH", str(tmp_path))
    assert bench_cli.cli([]) == 2
    assert capsys.readouterr().err.startswith("falcon-vllm: bench needs the repository checkout")


def test_bench_runs_vanilla_against_falcon_in_one_run(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from tests.vllm_util import save_target

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    t = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=1, seed=2)
    model = save_target(t, str(tmp_path / "tiny"))
    random_drafter(t, k=2).save_pretrained(str(tmp_path / "drafter"))
    assert bench_cli.cli(["--model", model, "--drafter", str(tmp_path / "drafter"), "--batch-sizes", "1",
                          "--pairs", "2", "--max-new-tokens", "8", "--dataset", "humaneval",
                          "--out-dir", str(tmp_path / "res")]) == 0
    res = json.loads((tmp_path / "res" / "bench.json").read_text())
    assert res["baseline"] == "vanilla" and res["command"].startswith("python benchmarks/ab_step.py --configs=vanilla,falcon")
    rows = {r["config"]: r for r in res["rows"]}
    assert set(rows) == {"vanilla", "falcon"}
    assert rows["vanilla"]["speedup_vs_base"] == 1.0 and rows["falcon"]["speedup_vs_base"] > 0
    assert rows["falcon"]["identical_to_base"] is True  # greedy: token for token vanilla's
    assert rows["falcon"]["tokens_per_generation"] == 8 and rows["falcon"]["pairs"] == 2
    assert rows["falcon"]["steps_per_generation"] <= rows["vanilla"]["steps_per_generation"]
    assert (tmp_path / "res" / "bench.md").read_text().startswith("# A/B in one process: bench")


def test_bench_writes_out_only_the_defaults_the_caller_did_not_give(monkeypatch):
    """The recorded command reruns the run: bench's defaults are written out, but not next to the caller's own."""
    seen = []
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(ab_step, "main", lambda argv, **kw: seen.append(argv))
    assert bench_cli.cli(["--configs", "eagle:2,falcon", "--pairs", "2"]) == 0
    assert seen[-1] == ["--name=bench", "--configs", "eagle:2,falcon", "--pairs", "2"]
    assert bench_cli.cli(["--name=x"]) == 0
    assert seen[-1] == ["--configs=vanilla,falcon", "--name=x"]
