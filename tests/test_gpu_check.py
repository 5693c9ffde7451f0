"""benchmarks/gpu_check.py on CPU: its small grid passes (the Triton kernels through the interpreter, in a
subprocess so that TRITON_INTERPRET=1 does not leak into this process), with vLLM's own objects here and with
its stand-ins (what a GPU machine without vLLM runs), and a broken oracle or plugin piece fails it."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402

from falcon_vllm.core.drafting import FalconDrafting  # noqa: E402

QUICK = ["--device", "cpu", "--quick", "--name", "g"]


def test_cpu_mode_passes(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", *QUICK, "--out-dir", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    res = json.loads((tmp_path / "g.json").read_text())
    rows = res["rows"]
    assert res["failed"] == 0 and rows and all(r["ok"] for r in rows)
    assert res["triton_mode"] == "triton-interpreter" and res["device"].startswith("CPU")
    cases = {c.id for c in gpu_check.grid(gpu_check.GRIDS["quick"])}
    assert {r["case"] for r in rows if r["piece"] != "chain-graph"} == cases
    done = {(r["piece"], r["path"]) for r in rows}
    for want in [("step", "_begin_tree_step"), ("attn-whole", "torch-ref"), ("attn-whole", "triton-interpreter"),
                 ("attn-rows", "torch-ref"), ("attn-rows", "triton-interpreter"), ("draft", "dense"),
                 ("draft", "triton-interpreter"), ("compact-kernel", "triton-interpreter"), ("compact-copies", "copy_kv_slots"),
                 ("chain-graph", "eager-padded")]:
        assert want in done, want
    assert {r["piece"] for r in rows} >= {"sampler-greedy", "sampler-topk1", "sampler-topp"}
    accepted = [int(r["note"].split()[0]) for r in rows if r["piece"] == "sampler-topp"]
    assert max(accepted) >= 3                                     # sampling accepted deep paths somewhere
    # the GPU-only measurements are skipped on CPU, never faked
    assert all(r["syncs"] is None and r["sync_sites"] is None and r["ms"] is None and r["peak_MiB"] is None
               for r in rows)
    assert not any(r["piece"].startswith("sampler-128k") for r in rows) and res["skipped"]
    assert (tmp_path / "g.md").read_text().startswith("# GPU check: CPU")
    if "vLLM's own" in res["vllm"]:  # vLLM importable: its allocator's views were used and matched the stand-in's
        assert "create_kv_cache_views" in res["vllm"]


def _main(tmp_path, *extra):
    return gpu_check.main(QUICK + ["--stub-vllm", "--out-dir", str(tmp_path), *extra])


def test_stand_ins_pass_and_leave_no_trace(tmp_path):
    """The vLLM stand-ins (no Triton here unless this process runs interpreted) pass, and are gone afterwards."""
    before = {n: sys.modules.get(n) for n in gpu_check._STUBS}
    threads = torch.get_num_threads()
    assert _main(tmp_path) == 0
    res = json.loads((tmp_path / "g.json").read_text())
    assert res["failed"] == 0 and "stand-ins" in res["vllm"] and len(res["rows"]) > 100
    assert {n: sys.modules.get(n) for n in gpu_check._STUBS} == before and torch.get_num_threads() == threads


def _shorter_path(orig):
    def greedy(*a):
        path, bonus = orig(*a)
        return path[:-1], bonus
    return greedy


SABOTAGE = {  # piece -> (object, attribute, replacement given the original): a broken oracle or plugin piece
    "attn": (gpu_check, "oracle_ancestors", lambda orig: lambda parent, n: torch.ones(n, n, dtype=torch.bool).tril()),
    "draft": (gpu_check, "oracle_attention", lambda orig: lambda q, k, v, m, scale: orig(q, k, v, m, 2 * scale)),
    "compact": (gpu_check.Step, "check_moved",                  # the oracle moves each slot one row too far
                lambda orig: lambda self, src, dst, extra=(): orig(self, src, [d + 1 for d in dst], extra)),
    "sampler-greedy": (gpu_check, "oracle_greedy", _shorter_path),
    "sampler-topk1": ("falcon_vllm.vllm.tree_verify", "compact_kv", lambda orig: lambda *a, **k: None),  # plugin
    "chain-graph": (FalconDrafting, "gather_block_inputs",         # padded rows' relaxed blocks write K/V
                    lambda orig: lambda self, qs, last, slots, valid=None: orig(self, qs, last, slots)),
}


@pytest.mark.parametrize("piece", list(SABOTAGE))
def test_broken_oracle_or_plugin_fails(tmp_path, monkeypatch, piece):
    obj, attr, make = SABOTAGE[piece]
    if isinstance(obj, str):
        gpu_check.import_plugin()
        obj = sys.modules[getattr(sys.modules[obj], attr).__module__]  # where it is defined (and called from)
    monkeypatch.setattr(obj, attr, make(getattr(obj, attr)))
    assert _main(tmp_path, "--only", piece) == 1
    rows = json.loads((tmp_path / "g.json").read_text())["rows"]
    assert rows and all(r["piece"].startswith(piece) for r in rows)
    assert any(not r["ok"] for r in rows)


def test_sync_sites_count_sync_warnings_by_caller():
    """The CUDA sync count's breakdown: sync warnings grouped by the calling line (others ignored), most first."""
    import warnings

    def warn(msg, line):
        return warnings.WarningMessage(msg, UserWarning, os.path.join(ROOT, "falcon_vllm", "verify.py"), line)

    caught = [warn("called a synchronizing CUDA operation", 10), warn("other warning", 10),
              warn("called a synchronizing CUDA operation", 20), warn("called a synchronizing CUDA operation", 20)]
    assert gpu_check.sync_sites(caught) == {os.path.join("falcon_vllm", "verify.py") + ":20": 2,
                                            os.path.join("falcon_vllm", "verify.py") + ":10": 1}
    assert list(gpu_check.sync_sites(caught))[0].endswith(":20") and gpu_check.sync_sites([]) == {}
    rows = [dict(case=f"c{i}", piece="sampler-topp", path="p", ok=True, err=None, tol=None, syncs=n, sync_sites=sites,
                 peak_MiB=None, ms=None, note="") for i, (n, sites) in enumerate([(3, {"a.py:1": 2, "b.py:2": 1}),
                                                                                   (2, {"b.py:2": 2})])]
    summary = gpu_check.summary(rows)
    assert summary[0]["sync_sites"] == {"b.py:2": 3, "a.py:1": 2} and summary[0]["max_syncs"] == 3
    res = dict(device="d", command="c", torch="t", triton="t", vllm="v", cases=2, checks=2, failed=0, seconds=1.0,
               summary=summary, rows=rows, skipped=[])
    assert "- sampler-topp: `b.py:2` 3, `a.py:1` 2" in gpu_check.to_markdown(res)
