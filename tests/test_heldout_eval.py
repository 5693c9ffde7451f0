"""benchmarks/heldout_eval.py: every drafter and its tree are checked before any evaluation runs."""

import os
import sys

import pytest

from tests.vllm_util import save_target

from falcon_vllm.testing import random_drafter, tiny_llama

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import heldout_eval  # noqa: E402


def _target_and_drafters(tmp_path) -> str:
    """A tiny target (its directory returned) and two drafters: ``own`` (k=2, its tree chain-2) and ``bare``
    (k=1, no tree of its own, as vLLM's EAGLE layout)."""
    t = tiny_llama(vocab=256, hidden=64, heads=2, kv_heads=1, seed=2)
    model = save_target(t, str(tmp_path / "tiny"))
    own = random_drafter(t, k=2)
    own.config.tree = "chain-2"
    own.save_pretrained(str(tmp_path / "own"))
    bare = random_drafter(t, k=1)
    bare.config.tree = None
    bare.save_pretrained(str(tmp_path / "bare"))
    return model


def test_a_drafter_without_a_tree_stops_the_run_before_it_starts(tmp_path, monkeypatch):
    """--tree own with a drafter that names no tree (vLLM's EAGLE layout) is refused up front, not after the
    drafters before it were scored (their results were lost with the crash); so is an unknown tree."""
    model = _target_and_drafters(tmp_path)
    evaluated = []
    monkeypatch.setattr(heldout_eval, "eval_set", lambda *a, **k: evaluated.append(a) or [])
    argv = ["--model", model, "--drafter", f"a={tmp_path / 'own'}", "--drafter", f"b={tmp_path / 'bare'}",
            "--datasets", "mt-bench", "--work", str(tmp_path / "w"), "--out-dir", str(tmp_path / "res")]
    with pytest.raises(SystemExit, match="names no tree"):
        heldout_eval.main(argv + ["--tree", "own"])
    with pytest.raises(ValueError, match="unknown tree 'no-such-tree'"):
        heldout_eval.main(argv + ["--tree", "no-such-tree"])
    assert evaluated == [] and not (tmp_path / "res").exists()


def test_a_drafter_may_name_its_own_tree(tmp_path, monkeypatch):
    """label:<tree>=<dir> scores that drafter on that tree, whatever --tree says (so a drafter without a tree of
    its own runs beside --tree own); each row names the tree it was scored on."""
    model = _target_and_drafters(tmp_path)
    trees = []

    def fake_evaluate(drafter, samples, tree, k, *a, **kw):
        trees.append((k, len(tree.nodes)))
        return {"top1_by_block_position": [0.0] * k, "sim_tau": 1.0, "sim_tau_se": 0.0}

    monkeypatch.setattr(heldout_eval, "eval_set", lambda *a, **k: [])
    import falcon_vllm.train.evaluation as trainer
    monkeypatch.setattr(trainer, "evaluate", fake_evaluate)
    heldout_eval.main(["--model", model, "--drafter", f"a={tmp_path / 'own'}", "--drafter",
                       f"b:tree-2x1={tmp_path / 'bare'}", "--tree", "own", "--datasets", "mt-bench", "--work",
                       str(tmp_path / "w"), "--out-dir", str(tmp_path / "res"), "--name", "h"])
    assert trees == [(2, 2), (1, 4)]   # chain-2 for a (its own), tree-2x1's 4 nodes for b
    md = (tmp_path / "res" / "h.md").read_text()
    assert "| a | chain-2 |" in md and "| b | tree-2x1 |" in md
    with pytest.raises(SystemExit, match="label:<tree>=<dir>"):
        heldout_eval.main(["--model", model, "--drafter", f"={tmp_path / 'own'}", "--datasets", "mt-bench"])
