"""Which vLLM internals falcon-vllm touches does a vLLM release still have?  Checked from its sources, statically.

For each version, the published ``vllm==VERSION`` wheel is fetched once (``pip download --no-deps
--only-binary=:all:``, cached in ``~/.cache/falcon-vllm/wheels``), its Python sources are read straight out of
the wheel zip (nothing is installed, vllm is never imported) and parsed with :mod:`ast`.  Every entry of the
plugin's manifest (:mod:`falcon_vllm.vllm.patches`: ``PATCHES``, ``READS``, and the instance attributes
``RUNNER_ATTRS`` / ``INPUT_BATCH_ATTRS`` / ``IMPL_ATTRS`` checked at start-up) is classified as

* ``present``: the same module binds the name (a class member may be inherited);
* ``signature changed``: present, but a patched function no longer takes the parameters the manifest expects
  (both lists are shown);
* ``moved``: not where the manifest says, but a class / function of that name (with the member) is defined in
  another module of the release (named);
* ``gone``: neither.

  python benchmarks/vllm_surface.py 0.32.0 0.33.0 0.34.0
  python benchmarks/vllm_surface.py --wheel dist/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl
  python benchmarks/vllm_surface.py --source .venv/lib/python3.11/site-packages --out-dir out

Writes ``benchmarks/results/vllm_surface_<version>.{json,md}`` per release (``--no-report``: the table only).
``--check`` exits 1 when a non-optional entry is not present.
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field

from harness.paths import RESULTS
from harness.report import write_report

from falcon_vllm.vllm import patches  # imports no vLLM

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "falcon-vllm", "wheels")
STATUSES = ("present", "signature changed", "moved", "gone")
# the class INPUT_BATCH_ATTRS are read from (patches.py names the attributes only)
INPUT_BATCH = "vllm.v1.worker.gpu_input_batch:InputBatch"
_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?(def|class)[ \t]+(\w+)", re.M)


class FetchError(RuntimeError):
    pass


# ---------------------------------------------------------------------- the sources of one release
class Sources:
    """The ``vllm`` package's ``.py`` files of one release (a wheel zip or a directory), parsed on demand."""

    def __init__(self, texts: dict[str, callable], label: str):
        self._texts = texts          # module name -> () -> source text
        self.label = label
        self._parsed: dict[str, ModuleInfo | None] = {}
        self._index = None

    @classmethod
    def from_wheel(cls, path: str) -> "Sources":
        zf = zipfile.ZipFile(path)
        names = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        if not names:
            raise FetchError(f"{os.path.basename(path)} holds no vllm/*.py sources")
        read = lambda n: zf.read(n).decode("utf-8", "replace")  # noqa: E731
        return cls({_module_name(n): (lambda n=n: read(n)) for n in names}, os.path.basename(path))

    @classmethod
    def from_dir(cls, path: str) -> "Sources":
        """``path`` holds the ``vllm`` package (a site-packages directory, a source checkout) or is that package."""
        path = os.path.abspath(path)
        if os.path.basename(path) == "vllm" and os.path.isfile(os.path.join(path, "__init__.py")):
            path = os.path.dirname(path)
        pkg = os.path.join(path, "vllm")
        if not os.path.isfile(os.path.join(pkg, "__init__.py")):
            raise FetchError(f"no vllm package (vllm/__init__.py) under {path}")
        texts = {}
        for dirpath, dirnames, files in os.walk(pkg):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    full = os.path.join(dirpath, f)
                    rel = os.path.relpath(full, path).replace(os.sep, "/")
                    texts[_module_name(rel)] = lambda full=full: open(full, encoding="utf-8", errors="replace").read()
        return cls(texts, "source tree")

    def has_module(self, mod: str) -> bool:
        return mod in self._texts

    def module(self, mod: str) -> "ModuleInfo | None":
        if mod not in self._parsed:
            info = None
            if mod in self._texts:
                try:
                    info = ModuleInfo(mod, ast.parse(self._texts[mod]()), self._is_package(mod))
                except SyntaxError:
                    info = None
            self._parsed[mod] = info
        return self._parsed[mod]

    def _is_package(self, mod: str) -> bool:
        prefix = mod + "."
        return any(m.startswith(prefix) for m in self._texts)

    def version(self) -> str:
        info = self.module("vllm._version")
        if info is not None:
            for node in info.tree.body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
                        getattr(node, "value", None), ast.Constant):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets):
                        return str(node.value.value)
        m = re.match(r"vllm-([^-]+)-", self.label)
        return m.group(1) if m else "unknown"

    def index(self) -> dict[str, list[tuple[str, str, bool]]]:
        """name -> [(module, "def" | "class", top level?)] for every def/class line of every module (one regex
        pass; :meth:`definitions` parses the candidates)."""
        if self._index is None:
            idx: dict[str, list] = {}
            for mod, text in self._texts.items():
                for indent, kind, name in _DEF.findall(text()):
                    idx.setdefault(name, []).append((mod, kind, indent == ""))
            self._index = idx
        return self._index

    def definitions(self, name: str, kind: str, exclude: str = "") -> list[str]:
        """Modules (other than ``exclude``) that define a top-level class / function ``name``."""
        out = []
        for mod, k, top in self.index().get(name, ()):
            if not top or mod == exclude or mod in out:
                continue
            info = self.module(mod)
            node = info.defs.get(name) if info else None
            if node is not None and (isinstance(node, ast.ClassDef) if kind == "class"
                                     else isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
                out.append(mod)
        return sorted(out)

    # ------------------------------------------------------------------ name resolution
    def resolve(self, mod: str, name: str, depth: int = 0):
        """What ``mod.name`` is at run time, followed through imports: (module, node) with node a ClassDef,
        FunctionDef, another ast node (an assignment), "module" (a submodule) or None when unbound."""
        info = self.module(mod)
        if depth > 12:
            return None
        if info is None:
            return (f"{mod}.{name}", "module") if self.has_module(f"{mod}.{name}") else None
        if name in info.defs:
            return mod, info.defs[name]
        if name in info.imports:
            src_mod, src_name = info.imports[name]
            if src_name is None:
                return (src_mod, "module") if self.has_module(src_mod) else (src_mod, "external")
            if not src_mod.startswith("vllm"):
                return src_mod, "external"
            got = self.resolve(src_mod, src_name, depth + 1)
            if got is None and self.has_module(f"{src_mod}.{src_name}"):
                return f"{src_mod}.{src_name}", "module"
            return got
        if self.has_module(f"{mod}.{name}"):
            return f"{mod}.{name}", "module"
        return None

    def resolve_expr(self, mod: str, expr: ast.expr):
        """A base-class expression (``Name``, ``a.b.C``, ``Generic[T]``) -> (module, node) or None."""
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        parts = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        parts.append(expr.id)
        parts.reverse()
        got = self.resolve(mod, parts[0])
        for part in parts[1:]:
            if got is None or got[1] != "module":
                return None
            got = self.resolve(got[0], part)
        return got

    def members(self, mod: str, cls: ast.ClassDef, instance: bool = False, _seen=None) -> dict[str, tuple]:
        """name -> (kind, node, defining "module:Class") for a class and its bases found in the release.

        kinds: method, classmethod, staticmethod, property, field (annotated), attribute (assigned in the
        class body), init attribute (``self.x = ...`` in ``__init__`` / ``__post_init__``; in any method
        when ``instance``)."""
        _seen = set() if _seen is None else _seen
        if (mod, cls.name) in _seen:
            return {}
        _seen.add((mod, cls.name))
        out: dict[str, tuple] = {}
        for base in reversed(cls.bases):
            got = self.resolve_expr(mod, base)
            if got is not None and isinstance(got[1], ast.ClassDef):
                out.update(self.members(got[0], got[1], instance, _seen))
        owner = f"{mod}:{cls.name}"
        own: dict[str, tuple] = {}
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own[node.name] = (_method_kind(node), node, owner)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own[node.target.id] = ("field", node, owner)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        own[t.id] = ("attribute", node, owner)
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    instance or node.name in ("__init__", "__post_init__")):
                for name in _self_assigned(node):
                    if name not in own:
                        own[name] = ("init attribute", node, owner)
        out.update(own)
        return out


def _module_name(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _method_kind(node) -> str:
    for d in node.decorator_list:
        name = d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")
        if name in ("staticmethod", "classmethod"):
            return name
        if name in ("property", "cached_property"):
            return "property"
    return "method"


def _self_assigned(func) -> set[str]:
    names = set()
    for node in ast.walk(func):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def params(node) -> list[str]:
    """Parameter names in :func:`inspect.signature` order."""
    a = node.args
    out = [p.arg for p in a.posonlyargs + a.args]
    if a.vararg:
        out.append(a.vararg.arg)
    out += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        out.append(a.kwarg.arg)
    return out


class ModuleInfo:
    """A module's top-level bindings: ``defs`` (classes, functions, assignments) and ``imports``."""

    def __init__(self, mod: str, tree: ast.Module, is_package: bool):
        self.tree = tree
        self.defs: dict[str, ast.AST] = {}
        self.imports: dict[str, tuple[str, str | None]] = {}
        package = mod if is_package else mod.rpartition(".")[0]
        self._collect(tree.body, package)

    def _collect(self, body, package):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Name):
                            self.defs[sub.id] = node
                            self.imports.pop(sub.id, None)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    if alias.name != "*":
                        self.imports[alias.asname or alias.name] = (base, alias.name)
                        self.defs.pop(alias.asname or alias.name, None)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = (alias.name, None)
                    else:
                        top = alias.name.split(".")[0]
                        self.imports[top] = (top, None)
            elif isinstance(node, ast.If):
                test = node.test
                if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
                        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                    self._collect(node.orelse, package)   # type-checking imports do not exist at run time
                else:
                    self._collect(node.body, package)
                    self._collect(node.orelse, package)
            elif isinstance(node, ast.Try):
                self._collect(node.body, package)
                for h in node.handlers:
                    self._collect(h.body, package)
                self._collect(node.orelse, package)
                self._collect(node.finalbody, package)


# ---------------------------------------------------------------------- the manifest's entries
@dataclass
class Entry:
    section: str                  # "patch", "read", "instance"
    owner: str                    # "module:Class" or "module"
    name: str
    kind: str                     # "patch" | "methods" | "fields" | "instance"
    expected: tuple | None = None  # parameters the function must take
    exact: bool = False           # expected is the whole parameter list, not its leading part
    optional: bool = False
    why: str = ""
    status: str = ""
    detail: str = ""
    where: list = field(default_factory=list)

    @property
    def label(self) -> str:
        mod, _, cls = self.owner.partition(":")
        return f"{mod}:{cls + '.' if cls else ''}{self.name}"

    def row(self) -> dict:
        return {"section": self.section, "entry": self.label, "kind": self.kind, "optional": self.optional,
                "status": self.status, "detail": self.detail, "where": self.where,
                **({"expected_params": list(self.expected)} if self.expected is not None else {})}


def manifest(pm=patches) -> list[Entry]:
    """Every entry of ``PATCHES`` and ``READS`` (one per name) and the start-up instance attributes."""
    out = [Entry("patch", p.owner, p.name, "patch", p.params, False, p.optional, p.why) for p in pm.PATCHES]
    propose = getattr(pm, "PROPOSE_PARAMS", None)
    for owner, names, kind in pm.READS:
        for n in names:
            exact = propose is not None and n == "propose" and owner.endswith(":EagleProposer")
            out.append(Entry("read", owner, n, kind, tuple(propose) if exact else None, exact))
    runner = getattr(pm, "_RUNNER", None)
    if runner:
        out += [Entry("instance", runner, a, "instance") for a in getattr(pm, "RUNNER_ATTRS", ())]
        out += [Entry("instance", INPUT_BATCH, a, "instance") for a in getattr(pm, "INPUT_BATCH_ATTRS", ())]
    for owner, names, kind, optional in getattr(pm, "V2_READS", ()):  # Model Runner V2's speculator
        section = "instance" if kind == "instance" else "read"
        out += [Entry(section, owner, n, kind, optional=optional, why="Model Runner V2") for n in names]
    impls = [p for p in pm.PATCHES if p.name == "forward" and ":" in p.owner]
    for p in impls:
        out += [Entry("instance", p.owner, a, "instance", optional=p.optional) for a in getattr(pm, "IMPL_ATTRS", ())]
    return out


def _accepts(kind: str, member_kind: str) -> bool:
    if kind in ("methods", "patch-func"):
        return member_kind in ("method", "classmethod", "staticmethod")
    return True   # fields / instance attributes / patched attributes: any binding serves


def _compare(e: Entry, node, where: str) -> None:
    have = params(node)
    want = list(e.expected)
    if (have if e.exact else have[: len(want)]) != want:
        e.status = "signature changed"
        e.detail = f"{where} takes {have}, the manifest expects {want}{'' if e.exact else ' (leading)'}"


def classify(src: Sources, e: Entry) -> Entry:
    mod, _, cls = e.owner.partition(":")
    func_kind = "patch-func" if e.kind == "patch" and e.expected is not None else e.kind
    if cls:
        got = src.resolve(mod, cls)
        if got is not None and isinstance(got[1], ast.ClassDef):
            where = f"{got[0]}:{got[1].name}"
            m = src.members(got[0], got[1], instance=e.kind == "instance").get(e.name)
            if m is not None and _accepts(func_kind, m[0]):
                e.status, e.where = "present", [m[2]]
                e.detail = _kind_note(e, m, where)
                if e.expected is not None and m[0] != "property" and hasattr(m[1], "args"):
                    _compare(e, m[1], f"{m[2]}.{e.name}")
                return e
            e.status = "gone"
            e.detail = f"{where} exists, without {e.name}" + (f" as a method (it is {_a(m[0])})" if m else "")
            _hint(src, e, member=True)
            return e
        # the class is not where the manifest says: another module defining it, with the member
        detail = _owner_note(src, mod, cls, got)
        found, lacking = [], []
        for other in src.definitions(cls, "class", exclude=mod):
            node = src.module(other).defs[cls]
            m = src.members(other, node, instance=e.kind == "instance").get(e.name)
            (found if m is not None and _accepts(func_kind, m[0]) else lacking).append((other, m))
        if found:
            e.status, e.where = "moved", [f"{o}:{cls}" for o, _ in found]
            e.detail = f"{detail}; defined in {', '.join(e.where)}"
            other, m = found[0]
            if e.expected is not None and hasattr(m[1], "args") and params(m[1])[: len(e.expected)] != list(e.expected):
                e.detail += f" (and takes {params(m[1])}, not {list(e.expected)})"
            return e
        e.status = "gone"
        if lacking:
            detail += f"; a class {cls} in {', '.join(o for o, _ in lacking)} has no {e.name}"
        e.detail = detail
        return e
    # a module-level name
    got = src.resolve(mod, e.name)
    if got is not None and not (func_kind in ("methods", "patch-func") and got[1] == "module"):
        e.status, e.where = "present", [f"{got[0]}:{e.name}" if got[1] != "module" else got[0]]
        if isinstance(got[1], ast.ClassDef) and got[0] != mod:
            e.detail = f"bound to {got[0]}:{got[1].name}"
        elif got[1] == "external":
            e.detail = f"bound to {got[0]} (outside vllm)"
        if e.expected is not None and isinstance(got[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
            _compare(e, got[1], f"{got[0]}.{e.name}")
        return e
    detail = "module missing" if not src.has_module(mod) else f"{mod} exists, without {e.name}"
    others = src.definitions(e.name, "class", exclude=mod) + src.definitions(e.name, "def", exclude=mod)
    if others:
        e.status, e.where = "moved", [f"{o}:{e.name}" for o in sorted(set(others))]
        e.detail = f"{detail}; defined in {', '.join(e.where)}"
        return e
    e.status, e.detail = "gone", detail
    _hint(src, e, member=False)
    return e


def _kind_note(e: Entry, m, where: str) -> str:
    notes = []
    if m[2] != where:
        notes.append(f"inherited from {m[2]}")
    if e.kind == "fields" and m[0] != "field":
        notes.append(f"{_a(m[0])}, not a declared field")
    return "; ".join(notes)


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _owner_note(src: Sources, mod: str, cls: str, got) -> str:
    if not src.has_module(mod):
        return "module missing"
    if got is None:
        return f"{mod} exists, without {cls}"
    return f"{mod}.{cls} is not a class here"


def _hint(src: Sources, e: Entry, member: bool) -> None:
    """For a gone entry: where else a def of that name is (not counted as moved), when only a few are."""
    hits = sorted({m for m, k, top in src.index().get(e.name, ()) if k == "def" and top != member})
    if 0 < len(hits) <= 3:
        e.detail += f"; a def {e.name} exists in {', '.join(hits)}"


# ---------------------------------------------------------------------- fetching
def _version_key(v: str):
    try:
        from packaging.version import Version
        return Version(v)
    except Exception:   # noqa: BLE001  (no packaging, or not a PEP 440 version)
        return v


def cached_wheel(version: str, cache: str) -> str | None:
    want = _version_key(version)
    for path in sorted(glob.glob(os.path.join(cache, "vllm-*.whl"))):
        m = re.match(r"vllm-([^-]+)-", os.path.basename(path))
        if m and _version_key(m.group(1)) == want:
            return path
    return None


def fetch(version: str, cache: str = CACHE) -> str:
    """The ``vllm==version`` wheel, from the cache or downloaded into it; raises :class:`FetchError`."""
    if (path := cached_wheel(version, cache)) is not None:
        print(f"vllm {version}: cached {os.path.basename(path)}", file=sys.stderr)
        return path
    os.makedirs(cache, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"vllm=={version}",
           "-d", cache, "--progress-bar", "off", "--disable-pip-version-check"]
    print(f"vllm {version}: downloading the wheel (several hundred MB): {' '.join(cmd[1:])}", file=sys.stderr)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise FetchError(f"cannot run pip for vllm=={version}: {exc}") from exc
    tail = []
    for line in proc.stdout:
        print(f"  pip: {line.rstrip()}", file=sys.stderr)
        tail = (tail + [line.rstrip()])[-8:]
    if proc.wait() != 0:
        said = [t for t in tail if t.startswith("ERROR")] or [t for t in tail if t.strip()][-2:]
        said = [t if len(t) < 160 else t[:150] + " ..." for t in said]
        raise FetchError(f"pip download of vllm=={version} failed (exit {proc.returncode}): no network, or no such "
                         f"release? pip said: {' | '.join(said)}. "
                         "A local copy works too: --wheel PATH or --source DIR")
    if (path := cached_wheel(version, cache)) is None:
        raise FetchError(f"pip download of vllm=={version} succeeded but left no vllm-{version}-*.whl in {cache}")
    print(f"vllm {version}: saved {os.path.basename(path)}", file=sys.stderr)
    return path


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------- reporting
def analyse(src: Sources, pm=patches) -> dict:
    entries = [classify(src, e) for e in manifest(pm)]
    by = {sec: {s: sum(e.status == s for e in entries if e.section == sec) for s in STATUSES}
          for sec in ("patch", "read", "instance")}
    counts = {s: by["patch"][s] + by["read"][s] for s in STATUSES}
    missing = [e.label for e in entries if e.status != "present" and not e.optional and e.section != "instance"]
    return {"version": src.version(), "source": src.label, "counts": counts, "counts_by_section": by,
            "non_optional_not_present": missing, "rows": [e.row() for e in entries]}


def counts_line(res: dict) -> str:
    """``present / signature changed / moved / gone`` over PATCHES + READS, then per section."""
    c, by = res["counts"], res["counts_by_section"]
    slash = lambda d: " / ".join(str(d[s]) for s in STATUSES)  # noqa: E731
    return (f"vllm {res['version']}: {c['present']} present / {c['signature changed']} signature changed / "
            f"{c['moved']} moved / {c['gone']} gone, of {sum(c.values())} patched or read names "
            f"(patches {slash(by['patch'])} of {sum(by['patch'].values())}; reads {slash(by['read'])} of "
            f"{sum(by['read'].values())}); {len(res['non_optional_not_present'])} non-optional not present; "
            f"instance attributes {slash(by['instance'])} of {sum(by['instance'].values())}")


def table(res: dict) -> list[str]:
    rows = res["rows"]
    width = max(len(r["entry"]) for r in rows)
    out = [f"== vllm {res['version']} ({res['source']})", f"{'status':<18} {'section':<9} {'entry':<{width}}  detail"]
    for r in rows:
        opt = " (optional)" if r["optional"] else ""
        out.append(f"{r['status']:<18} {r['section']:<9} {r['entry']:<{width}}  {r['detail']}{opt}")
    out.append(counts_line(res))
    return out


def markdown(res: dict, command: str) -> list[str]:
    lines = [f"# vLLM {res['version']}: falcon-vllm's patched and read internals", "",
             f"`{command}`: the release's sources ({res['source']}"
             + (f", sha256 {res['sha256'][:16]}…" if res.get("sha256") else "")
             + ") parsed against `falcon_vllm/vllm/patches.py` (nothing installed or imported).", "",
             f"**{counts_line(res)}**", ""]
    for section, title in (("patch", "Patched (PATCHES)"), ("read", "Read (READS)"),
                           ("instance", "Instance attributes checked at start-up")):
        if not any(r["section"] == section for r in res["rows"]):
            continue
        lines += [f"## {title}", "", "| status | entry | detail |", "|---|---|---|"]
        for r in res["rows"]:
            if r["section"] == section:
                opt = " *(optional)*" if r["optional"] else ""
                lines.append(f"| {r['status']} | `{r['entry']}`{opt} | {r['detail'].replace('|', '/')} |")
        lines.append("")
    return lines


def main(argv=None, pm=patches) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("versions", nargs="*", help="vLLM releases to fetch from PyPI (vllm==VERSION)")
    p.add_argument("--wheel", action="append", default=[], help="a local vllm wheel (repeatable)")
    p.add_argument("--source", action="append", default=[],
                   help="a directory holding the vllm package, e.g. a site-packages directory (repeatable)")
    p.add_argument("--cache", default=CACHE, help="where downloaded wheels are kept (default %(default)s)")
    p.add_argument("--out-dir", default=RESULTS)
    p.add_argument("--no-report", action="store_true", help="print the table only, write no results files")
    p.add_argument("--check", action="store_true", help="exit 1 when a non-optional entry is not present")
    a = p.parse_args(argv)
    if not (a.versions or a.wheel or a.source):
        p.error("name a VERSION, --wheel PATH or --source DIR")
    command = "python benchmarks/vllm_surface.py " + " ".join(argv if argv is not None else sys.argv[1:])
    targets = [("version", v) for v in a.versions] + [("wheel", w) for w in a.wheel] + [("source", s) for s in a.source]
    failed, incomplete = [], False
    for kind, what in targets:
        try:
            if kind == "source":
                src, wheel = Sources.from_dir(what), None
            else:
                wheel = fetch(what, a.cache) if kind == "version" else what
                if not os.path.isfile(wheel):
                    raise FetchError(f"no such wheel: {wheel}")
                src = Sources.from_wheel(wheel)
        except (FetchError, zipfile.BadZipFile) as exc:
            print(f"vllm_surface: {exc}", file=sys.stderr)
            failed.append(what)
            continue
        res = analyse(src, pm)
        if wheel is not None:
            res["sha256"] = _sha256(wheel)
        print("\n".join(table(res)) + "\n")
        if res["non_optional_not_present"]:
            incomplete = True
        if not a.no_report:
            write_report(a.out_dir, f"vllm_surface_{res['version']}", {"command": command, **res},
                         markdown(res, command))
    for res_line in failed:
        print(f"vllm_surface: not checked: {res_line}", file=sys.stderr)
    if failed:
        return 2
    return 1 if a.check and incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
