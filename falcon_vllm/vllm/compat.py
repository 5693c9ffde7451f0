"""Work-arounds for third-party behaviour that breaks vLLM in a long-lived process.

vLLM re-registers its Triton kernel overrides each time an engine starts and, to do so, scans every
module's globals with ``hasattr(value, "__dict__")`` (``vllm.triton_utils.dispatcher``).  llvmlite's
library wrapper (loaded with numba, which vLLM's ``ngram`` proposer uses) answers *any* attribute
name with a C-function wrapper, ``__dict__`` included, so the scan crashes with
``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``: any engine created after an
``ngram`` engine in the same process fails to start.  The benchmark harness and the tests run several
engines in one process, so :func:`install` makes the wrapper refuse dunder names, as ``ctypes.CDLL``
itself does.  It only touches llvmlite once llvmlite is imported, right before vLLM's scan.
"""

from __future__ import annotations

import functools
import sys


def guard_llvmlite() -> bool:
    """Make llvmlite's ``_lib_wrapper`` raise AttributeError for ``__dunder__`` names.

    Returns True when the guard is (now) in place, False when llvmlite is not loaded.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    cls = getattr(ffi, "_lib_wrapper", None)
    if cls is None:
        return False
    if getattr(cls, "_falcon_guarded", False):
        return True
    original = cls.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    cls.__getattr__ = __getattr__
    cls._falcon_guarded = True
    return True


def install() -> None:
    """Guard llvmlite right before each kernel-override scan of vLLM (idempotent)."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # another vLLM layout: nothing to guard
        return
    scan = getattr(dispatcher, "_rebind_kernels", None)
    if scan is None or getattr(scan, "_falcon_guarded", False):
        return

    @functools.wraps(scan)
    def _rebind_kernels(*args, **kwargs):
        guard_llvmlite()
        return scan(*args, **kwargs)

    _rebind_kernels._falcon_guarded = True
    dispatcher._rebind_kernels = _rebind_kernels
