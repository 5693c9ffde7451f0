"""The package's shape: no module of falcon_vllm over about 500 lines and no function over about 80 (the Triton
kernels excepted).  Import circles: tests/test_import_graph.py."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "falcon_vllm"
MAX_MODULE_LINES = 520
MAX_FUNCTION_LINES = 85


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_and_function_sizes(name):
    path = _modules()[name]
    if "kernels" in path.parts:
        pytest.skip("Triton kernels are exempt")
    text = path.read_text()
    assert text.count("\n") <= MAX_MODULE_LINES, f"{path.name}: {text.count(chr(10))} lines"
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"
