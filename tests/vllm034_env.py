"""A side environment where ``import vllm`` is vLLM 0.34: the wheel's Python sources, unpacked into a cache
directory and put first on PYTHONPATH of a subprocess that runs with this environment's torch (CPU).

The wheel comes from ``~/.cache/falcon-vllm/wheels`` (``benchmarks/vllm_surface.py``'s cache), else from
``pip download --no-deps vllm==0.34.0`` with a time limit; without it :class:`Unavailable` says why (tests skip).
Only ``vllm/**.py`` and the dist-info are unpacked: the wheel's compiled extensions are CUDA builds that do
not load here, and 0.34 imports them guarded (``vllm._C``: a logged warning).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
VERSION = "0.34.0"
SOURCES_ENV = "FALCON_VLLM_034_SOURCES"  # where the sources are unpacked (default under ~/.cache/falcon-vllm)
DOWNLOAD_TIMEOUT_S = 600  # a fresh clone's cache is empty: pip download of a ~240 MB wheel
RESULT = "RESULT "  # the subprocess prints its result as one JSON line after this prefix
COMPLETE = ".complete"  # written last: a directory without it is a half-done unpack


class Unavailable(Exception):
    """The 0.34 sources cannot be had here (the reason is the message)."""


def sources_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "falcon-vllm", f"vllm-{VERSION}-src")
    return os.environ.get(SOURCES_ENV) or default


BENCHMARKS = os.path.join(ROOT, "benchmarks")  # vllm_surface.py: the wheel cache and its fetching


def _surface():
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import vllm_surface

    return vllm_surface


def wheel(timeout_s: float = DOWNLOAD_TIMEOUT_S, cache: str | None = None) -> str:
    """The vllm==0.34.0 wheel in ``cache`` (default: vllm_surface's), downloaded into it first when missing."""
    vs = _surface()
    cache = cache or vs.CACHE
    if (path := vs.cached_wheel(VERSION, cache)) is not None:
        return path
    code = (f"import sys; sys.path.insert(0, {BENCHMARKS!r}); import vllm_surface as vs; "
            f"vs.fetch({VERSION!r}, {cache!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # its own group: a timeout ends pip too
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise Unavailable(f"pip download of vllm=={VERSION} took over {timeout_s:.0f} s") from None
    if proc.returncode != 0 or (path := vs.cached_wheel(VERSION, cache)) is None:
        raise Unavailable(f"no vllm=={VERSION} wheel in {cache} and pip download failed: {out.strip()[-300:]}")
    return path


def sources(timeout_s: float = DOWNLOAD_TIMEOUT_S) -> str:
    """The directory holding 0.34's ``vllm`` package (Python files only), unpacked once."""
    target = sources_dir()
    if os.path.exists(os.path.join(target, COMPLETE)):
        return target
    whl = wheel(timeout_s)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(target) + ".", dir=os.path.dirname(target))
    try:
        with zipfile.ZipFile(whl) as z:
            z.extractall(tmp, [n for n in z.namelist()
                               if (n.startswith("vllm/") and n.endswith(".py")) or ".dist-info/" in n])
        open(os.path.join(tmp, COMPLETE), "w").close()
        shutil.rmtree(target, ignore_errors=True)  # a half-done unpack
        os.replace(tmp, target)
    except OSError:
        if not os.path.exists(os.path.join(target, COMPLETE)):  # else another run unpacked it meanwhile
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def run(code: str, timeout_s: float = 600, env: dict | None = None) -> dict:
    """Run ``code`` in a subprocess whose ``vllm`` is 0.34 and return the JSON it printed after RESULT.

    The subprocess loads no vLLM plugins (the installed falcon_vllm entry point registers the V1 plugin,
    which refuses 0.34): the code calls what it tests itself.
    """
    src = sources()
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, ROOT]), VLLM_PLUGINS="", HF_HUB_OFFLINE="1",
                     **(env or {}))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          env=child_env, cwd=ROOT)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise AssertionError(f"the 0.34 subprocess printed no result (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
