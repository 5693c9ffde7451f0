"""The product face stays current: the README's headline table and the results index match the result files,
the README and the model cards stay short, and every relative link in the README, docs/ and the model cards
points at a file that exists."""

import glob
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARDS = sorted(glob.glob(os.path.join(REPO, "falcon_vllm", "drafters", "*", "README.md")))
PAGES = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) + CARDS
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_readme_headline_table_is_current():
    r = _run("headline.py")
    assert r.returncode == 0, r.stdout + r.stderr


def test_results_index_is_current():
    r = _run("results_index.py")
    assert r.returncode == 0, r.stdout + r.stderr


def _lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return len(f.read().splitlines())


def test_readme_is_short():
    assert _lines(os.path.join(REPO, "README.md")) <= 250


@pytest.mark.parametrize("card", CARDS, ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_model_card_is_short(card):
    assert _lines(card) <= 80


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_point_at_files(page):
    with open(page, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold commands, not links
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
        if not os.path.exists(path):
            missing.append(target)
    assert not missing, f"{os.path.relpath(page, REPO)} links to missing files: {missing}"


MACHINE_PATH = re.compile(r"(?<![\w.~])/(root|home|tmp|work|Users)/")


def test_published_files_name_no_machine_paths():
    """Result files, docs, the README and the shipped drafters' files never name a path of the machine that
    wrote them (the harness makes paths portable; a hand-written note must too)."""
    tracked = subprocess.run(["git", "ls-files", "README.md", "docs", "benchmarks/results", "falcon_vllm/drafters"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for rel in tracked:
        if not rel.endswith((".md", ".json", ".txt", ".csv")):
            continue
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if MACHINE_PATH.search(line):
                    found.append(f"{rel}:{n}")
    assert tracked and not found, f"machine paths in: {found[:20]}"


def test_findings_are_short():
    """docs/findings.md holds the current conclusions; the dated log lives in docs/findings-archive.md."""
    assert _lines(os.path.join(REPO, "docs", "findings.md")) <= 300


# a measured figure: a ratio (1.23x), a rate, a time, a share
MEASUREMENT = re.compile(r"\d+(\.\d+)?x\b|tokens/s|\bms\b|\d+(\.\d+)? ?%")


def test_module_docstrings_describe_code_not_measurements():
    """Measurements belong in docs/findings.md and the result pages, where they carry their run; a module's docstring
    says what the code does."""
    import ast

    modules = sorted(glob.glob(os.path.join(REPO, "falcon_vllm", "**", "*.py"), recursive=True))
    found = []
    for path in modules:
        with open(path, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        found += [f"{os.path.relpath(path, REPO)}: {m.group(0)!r}" for m in MEASUREMENT.finditer(doc)]
    assert len(modules) > 20 and not found, found
    assert MEASUREMENT.search("ran 1.64x vanilla") and not MEASUREMENT.search("k=2 drafts 2 tokens")


def test_current_results_stay_out_of_the_archive_and_the_rest_in_it():
    """Every top-level result is one a current page or script names, and no newer run generation supersedes it
    (``python benchmarks/results_index.py --archive`` moves the others)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import results_index
    finally:
        sys.path.pop(0)
    stems = results_index.results()
    top = {s for s in stems if "/" not in s}
    stale = sorted(top - results_index.current(stems)) + sorted(set(results_index.superseded(stems)) & top)
    assert top and not stale, f"results to move into archive/: {stale}"
