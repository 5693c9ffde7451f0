"""Timers wrapped around the methods of a running engine (a component's inclusive time per step)."""

from __future__ import annotations

import time
from collections import defaultdict


class Timers:
    """Inclusive wall-clock time and calls per component name, summed while ``on``."""

    def __init__(self):
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.on = False

    def wrap(self, owner, attr, name, when=None):
        """Time ``owner.attr`` (a class or an instance) as component ``name`` while timing is on."""
        orig = getattr(owner, attr)
        timers = self

        def timed(*a, **kw):
            if not timers.on or (when is not None and not when()):
                return orig(*a, **kw)
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                timers.total[name] += time.perf_counter() - t0
                timers.calls[name] += 1

        if hasattr(orig, "__falcon_original__"):  # still counts as installed (falcon_vllm.vllm.patches.wrap)
            timed.__falcon_original__ = orig.__falcon_original__
        setattr(owner, attr, timed)
        return orig
