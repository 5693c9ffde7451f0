"""benchmarks/heldout_eval.py: every drafter and its tree are checked before any evaluation runs."""

import os
import sys

import pytest

from tests.vllm_util import save_target

from falcon_vllm.testing import random_drafter, tiny_llama

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import heldout_eval  # noqa: E402


def test_a_drafter_without_a_tree_stops_the_run_before_it_starts(tmp_path, monkeypatch):
    """--tree own with a drafter that names no tree (vLLM's EAGLE layout) is refused up front, not after the
    drafters before it were scored (their results were lost with the crash); so is an unknown tree."""
    t = tiny_llama(vocab=256, hidden=64, heads=2, kv_heads=1, seed=2)
    model = save_target(t, str(tmp_path / "tiny"))
    own = random_drafter(t, k=2)
    own.config.tree = "chain-2"
    own.save_pretrained(str(tmp_path / "own"))
    bare = random_drafter(t, k=1)
    bare.config.tree = None
    bare.save_pretrained(str(tmp_path / "bare"))
    evaluated = []
    monkeypatch.setattr(heldout_eval, "eval_set", lambda *a, **k: evaluated.append(a) or [])
    argv = ["--model", model, "--drafter", f"a={tmp_path / 'own'}", "--drafter", f"b={tmp_path / 'bare'}",
            "--datasets", "mt-bench", "--work", str(tmp_path / "w"), "--out-dir", str(tmp_path / "res")]
    with pytest.raises(SystemExit, match="names no tree"):
        heldout_eval.main(argv + ["--tree", "own"])
    with pytest.raises(ValueError, match="unknown tree 'no-such-tree'"):
        heldout_eval.main(argv + ["--tree", "no-such-tree"])
    assert evaluated == [] and not (tmp_path / "res").exists()
