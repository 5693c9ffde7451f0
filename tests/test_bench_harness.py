"""benchmarks/harness and the folder around it: configuration names, portable settings, result files, the results
index's run generations and archive, the studies' headers, and the README's table of every tool."""

import ast
import glob
import json
import os
import re
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
_env = dict(os.environ)
import results_index  # noqa: E402
from harness import engines, paths  # noqa: E402
from harness.machine import cpu_name  # noqa: E402
from harness.report import write_report  # noqa: E402
from harness.timing import Timers  # noqa: E402

for _k in set(os.environ) - set(_env):  # the harness's environment defaults stay out of the other tests
    del os.environ[_k]

D = "/d/falcon"


@pytest.mark.parametrize("cfg, spec", [
    ("vanilla", None),
    ("falcon", {"method": "falcon", "model": D}),
    ("chain", {"method": "falcon", "model": D, "num_speculative_tokens": 2}),
    ("chain:3", {"method": "falcon", "model": D, "num_speculative_tokens": 3}),
    ("lookup", {"method": "falcon", "model": D, "num_speculative_tokens": 4, "drafter_tokens": 2,
                "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
    ("lookup:8:3:5:1", {"method": "falcon", "model": D, "num_speculative_tokens": 8, "drafter_tokens": 3,
                        "prompt_lookup_min": 1, "prompt_lookup_max": 4, "lookup_tokens": 5}),
    ("tree", {"method": "falcon", "model": D, "tree": "tree-2x2x1"}),
    ("tree:t.json", {"method": "falcon", "model": D, "tree": os.path.join(paths.ROOT, "t.json")}),
    ("eagle:3", {"method": "eagle", "model": "/d/eagle", "num_speculative_tokens": 3}),
    ("ngram", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
    ("chain:2@/other", {"method": "falcon", "model": "/other", "num_speculative_tokens": 2}),
    ("draft:4@/small", {"method": "draft_model", "model": "/small", "num_speculative_tokens": 4}),
    ("falcon%draft_gemm_dtype=model%datastore=false",
     {"method": "falcon", "model": D, "draft_gemm_dtype": "model", "datastore": False}),
])
def test_configuration_names(cfg, spec):
    assert engines.spec_for(cfg, D, 2, "/d/eagle") == spec


def test_draft_model_defaults_to_the_qwen_pair(monkeypatch):
    """draft[:K] without @<dir>: the converted Qwen2.5-Coder-0.5B-Instruct (looked up only when named)."""
    import falcon_vllm.models

    asked = []
    monkeypatch.setattr(falcon_vllm.models, "model_path", lambda name: asked.append(name) or f"/m/{name}")
    assert engines.spec_for("draft", D, 3) == {"method": "draft_model", "model": "/m/qwen2.5-coder-0.5b-instruct",
                                               "num_speculative_tokens": 3}
    engines.spec_for("chain", D, 3)
    assert asked == ["qwen2.5-coder-0.5b-instruct"]


@pytest.mark.parametrize("cfg, error", [
    ("beam", "unknown configuration 'beam'"),
    ("vanilla%k=1", "vanilla takes no speculative-config options"),
    ("falcon%k", "option 'k' in configuration 'falcon' is not key=value"),
])
def test_bad_configuration_names_are_refused(cfg, error):
    with pytest.raises(SystemExit, match=f"^falcon-vllm: {re.escape(error)}"):
        engines.spec_for(cfg, D, 2)


def test_proposer_attributes_and_compile_words():
    assert engines.proposer_attrs("falcon^prune_chunk=false^rows=3") == ("falcon", {"prune_chunk": False, "rows": 3})
    assert engines.proposer_attrs("chain:2") == ("chain:2", {})
    assert engines.compile_words("") == "eager" and engines.compile_words("all") == "torch.compile (vLLM default)"
    assert engines.compile_words("falcon") == "torch.compile for falcon, the others eager"


def test_portable_settings_name_no_machine_paths():
    assert paths.portable(paths.DEFAULT_DRAFTER) == os.path.join("falcon_vllm", "drafters", "smollm2-135m-instruct")
    assert paths.portable("/elsewhere/model/") == "model"
    assert paths.portable("relative/dir") == "relative/dir" and paths.portable(3) == 3 and paths.portable(None) is None


def test_machine_and_report(tmp_path, capsys):
    assert re.search(r", \d+ CPUs", cpu_name())
    out = write_report(str(tmp_path / "r"), "x", {"rows": [1]}, ["# x", "", "| a |"])
    assert out == str(tmp_path / "r" / "x")
    assert json.loads((tmp_path / "r" / "x.json").read_text()) == {"rows": [1]}
    assert (tmp_path / "r" / "x.md").read_text() == "# x\n\n| a |\n"
    assert "wrote" in capsys.readouterr().out


def test_timers_count_only_while_on():
    class Runner:
        def step(self, x):
            return x + 1

    timers, runner = Timers(), Runner()
    timers.wrap(runner, "step", "step")
    assert runner.step(1) == 2 and timers.calls["step"] == 0
    timers.on = True
    assert runner.step(2) == 3 and timers.calls["step"] == 1 and timers.total["step"] > 0


def test_run_generations_supersede_older_ones():
    stems = ["ab_v3_b1_gsm8k", "ab_v6_b1_gsm8k", "ab_b1_gsm8k", "ab_v6_b1_gsm8k_xeon", "archive/e2e_v2_b1",
             "e2e_v6_b1", "gpu/k_b1", "k_b1", "vllm_surface_0.32.0", "vllm_surface_0.34.0"]
    assert results_index.superseded(stems) == {
        "ab_v3_b1_gsm8k": "ab_v6_b1_gsm8k", "ab_b1_gsm8k": "ab_v6_b1_gsm8k", "archive/e2e_v2_b1": "e2e_v6_b1"}


def test_archive_moves_a_superseded_result_and_its_plots(tmp_path, monkeypatch):
    monkeypatch.setattr(results_index, "RESULTS", str(tmp_path))
    for f in ("e2e_b1.json", "e2e_b1.md", "e2e_b1_speedup.png", "e2e_b1_x.json", "e2e_v2_b1.json", "e2e_v2_b1.md"):
        (tmp_path / f).write_text("{}")
    assert results_index.archive(results_index.results()) == ["e2e_b1"]
    assert sorted(os.listdir(tmp_path / "archive")) == ["e2e_b1.json", "e2e_b1.md", "e2e_b1_speedup.png"]
    assert {"e2e_b1_x.json", "e2e_v2_b1.json", "e2e_v2_b1.md"} <= set(os.listdir(tmp_path))
    assert results_index.superseded(results_index.results()) == {"archive/e2e_b1": "e2e_v2_b1"}


def test_machine_from_the_json_else_from_the_name():
    assert results_index.machine_of("ab_x_avx2", {"machine": "AMD EPYC, 2 CPUs, AVX2; torch 2.13"}) == \
        "AMD EPYC, 2 CPUs, AVX2"
    assert results_index.machine_of("ab_v8_b1_gsm8k_epyc", {}) == "AMD EPYC (name)"
    assert results_index.machine_of("heldout_eval_turn2", None) == ""


def _docstring(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


@pytest.mark.parametrize("study", sorted(glob.glob(os.path.join(BENCH, "studies", "*.py"))), ids=os.path.basename)
def test_a_study_is_headed_by_its_question_answer_and_result(study):
    doc = _docstring(study)
    assert doc.startswith("Study: ") and "?" in doc.split("\n\n")[0], "the first paragraph asks the question"
    assert re.search(r"^Answer: \S", doc, re.M)
    page = re.search(r"^Result: (benchmarks/results/\S+\.md)$", doc, re.M)
    assert page and os.path.exists(os.path.join(paths.ROOT, page.group(1)))


def test_the_readme_table_lists_every_tool_and_study():
    with open(os.path.join(BENCH, "README.md"), encoding="utf-8") as f:
        table = [line for line in f.read().splitlines() if line.startswith("| ")]
    listed = set(re.findall(r"`((?:studies/)?\w+\.(?:py|sh))`", "\n".join(table)))
    scripts = {os.path.relpath(p, BENCH) for pat in ("*.py", "*.sh", "studies/*.py")
               for p in glob.glob(os.path.join(BENCH, pat))}
    assert listed == scripts


def test_maintained_tools_import_the_harness_not_one_another_by_path():
    for path in glob.glob(os.path.join(BENCH, "*.py")):
        with open(path, encoding="utf-8") as f:
            src = f.read()
        if os.path.basename(path) == "gpu_check.py":  # imports the plugin from the checkout when not installed
            src = src.replace("sys.path.insert(0, ROOT)", "")
        assert not re.search(r"sys\.path(\.insert|\.append|\[| *=| *\+=)", src), os.path.basename(path)


def test_gpu_suite_is_valid_bash_and_runs_existing_tools():
    suite = os.path.join(BENCH, "gpu_suite.sh")
    assert subprocess.run(["bash", "-n", suite]).returncode == 0
    with open(suite, encoding="utf-8") as f:
        tools = set(re.findall(r"benchmarks/(\w+\.py)", f.read()))
    assert tools and all(os.path.exists(os.path.join(BENCH, t)) for t in tools)


def test_soak_server_help_names_its_load():
    run = subprocess.run([sys.executable, os.path.join(BENCH, "soak_server.py"), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0
    assert all(opt in run.stdout for opt in ("--tree", "--clients", "--duration", "--max-rss-growth"))


def test_fingerprint_compare_names_every_difference():
    import fingerprint

    row = {"b1 greedy": [[1, 2], [3]], "b1 sampled": [[4], [5]], "b1 greedy counters": {"num_drafts": 3}}
    old = {"configs": {"falcon": row}}
    assert fingerprint.compare({"configs": {"falcon": dict(row)}}, old) == []
    changed = {"configs": {"falcon": {**row, "b1 greedy": [[1, 2], [9]], "b1 greedy counters": {"num_drafts": 4}},
                           "tree": row}}
    diffs = fingerprint.compare(changed, old)
    assert any("falcon b1 greedy: prompts [1]" in d for d in diffs)
    assert any("falcon b1 greedy counters" in d for d in diffs)
    assert any(d.startswith("tree: not in") for d in diffs)


def test_results_name_no_machine_path(monkeypatch):
    """A recorded command and a configuration label keep repository paths relative and cut any other absolute path
    to its last component (tree:/somewhere/tree.json -> tree:tree.json)."""
    inside = os.path.join(paths.ROOT, "benchmarks", "t.json")
    assert paths.portable_text("tree:/opt/runs/qwen-tree.json") == "tree:qwen-tree.json"
    assert paths.portable_text("chain:2@/opt/runs/d%k=1") == "chain:2@d%k=1"
    assert paths.portable_text(f"tree:{inside}") == "tree:benchmarks/t.json"
    assert paths.portable_text("vanilla,chain:2") == "vanilla,chain:2"
    monkeypatch.setattr(sys, "argv",
                        ["ab_step.py", "--model", "/opt/models/q-float32", f"--configs=vanilla,tree:{inside}"])
    assert engines.command_line("ab_step.py") == (
        "python benchmarks/ab_step.py --model q-float32 --configs=vanilla,tree:benchmarks/t.json")


def test_profile_step_times_functions_that_exist():
    """profile_step wraps tree mode's functions by name: a rename must fail here, not in a long profiling run."""
    import profile_step

    for owner, attr, component in profile_step.tree_timed():
        assert callable(getattr(owner, attr)), (owner, attr)
        assert component in profile_step.COMPONENTS


def test_benchmarks_default_to_the_drafter_shipped_for_the_model(tmp_path):
    """--model without --drafter: the drafter shipped for that target (and its -eagle sibling); a target with none
    keeps SmolLM2's pair, so runs without a drafter still start and the others fail on the plugin's error."""
    from transformers import LlamaConfig

    from falcon_vllm.config import FalconConfig
    from harness.paths import DEFAULT_DRAFTER, DEFAULT_EAGLE, drafters_for

    assert drafters_for(None, None, None) == (DEFAULT_DRAFTER, DEFAULT_EAGLE)
    assert drafters_for(None, "d", "e") == ("d", "e")
    t = FalconConfig.load(DEFAULT_DRAFTER).target
    LlamaConfig(hidden_size=t["hidden_size"], vocab_size=t["vocab_size"], num_hidden_layers=t["num_hidden_layers"],
                num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536).save_pretrained(tmp_path / "s")
    assert drafters_for(str(tmp_path / "s"), None, None) == (DEFAULT_DRAFTER, DEFAULT_EAGLE)
    assert drafters_for(str(tmp_path / "s"), "mine", None) == ("mine", DEFAULT_EAGLE)
    LlamaConfig(hidden_size=64, vocab_size=128, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128).save_pretrained(tmp_path / "other")
    assert drafters_for(str(tmp_path / "other"), None, None) == (DEFAULT_DRAFTER, DEFAULT_EAGLE)


@pytest.mark.parametrize("build_order, built", [("given", ["vanilla", "chain:2", "ngram"]),
                                                ("reversed", ["ngram", "chain:2", "vanilla"])])
def test_build_order_builds_the_engines_in_order_and_keeps_the_baseline_first(monkeypatch, build_order, built):
    """--build-order reversed builds the last configuration's engine first; the labels, the engines' order and the
    baseline (the first configuration) do not change, so the same comparison can be measured both ways."""
    import types

    import vllm

    from falcon_vllm.vllm import proposer

    made = []

    class FakeLLM:
        def __init__(self, speculative_config=None, **kw):
            made.append(speculative_config)
            runner = types.SimpleNamespace(execute_model=lambda *a, **k: None,
                                           propose_draft_token_ids=lambda *a, **k: None)
            self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
                driver_worker=types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=runner))))
            self.spec = speculative_config

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(proposer, "falcon_proposer", lambda runner: None)
    args = types.SimpleNamespace(configs=["vanilla", "chain:2", "ngram"], compile="", drafter=D,
                                 eagle_drafter="/d/eagle", num_spec_tokens=2, build_order=build_order)
    labels, built_engines, _, step_count = engines.build_engines(args, "/m", 1)
    assert labels == ["vanilla", "chain:2", "ngram"]
    assert list(built_engines) == labels and list(step_count) == labels
    assert made == [engines.spec_for(c, D, 2, "/d/eagle") for c in built]
    assert [built_engines[c].spec for c in labels] == [engines.spec_for(c, D, 2, "/d/eagle") for c in labels]
