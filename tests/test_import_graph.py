"""The package's import graph: no module imports one that imports it back (at module level or inside a function),
and the drafting core imports nothing of vLLM."""

import ast
from pathlib import Path

import falcon_vllm

ROOT = Path(falcon_vllm.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = ("falcon_vllm",) + f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(path: Path, modules) -> set[str]:
    """The package modules ``path`` imports anywhere in it (``from pkg import mod`` counts as mod alone)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            deps |= subs or {node.module}
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names}
    return deps & modules.keys()


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {m: _imports(f, modules) - {m} for m, f in modules.items()}
    assert "falcon_vllm.vllm.proposer" in graph["falcon_vllm.vllm.hooks"]  # the scan sees lazy imports
    circles = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph[b])
    assert circles == []


def test_the_drafting_core_imports_no_vllm():
    """falcon_vllm.core, what both runners' adapters drive, imports nothing of vLLM nor of falcon_vllm.vllm."""
    files = sorted((ROOT / "core").glob("*.py"))
    assert {f.stem for f in files} >= {"drafting", "plan", "stash", "lookup", "tree_draft", "paged_kv"}
    for f in files:
        tree = ast.parse(f.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        bad = [n for n in names if n.split(".")[0] == "vllm" or n.startswith("falcon_vllm.vllm")]
        assert not bad, f"{f.name} imports {bad}"
