"""Keep blocks whose drafter K/V has holes out of vLLM's prefix cache.

The drafter's K/V lives in the same KV-cache blocks as the target's, and the prefix cache shares full blocks between
requests.  When a step's verified rows reach no drafter pass (drafting off past ``gap_rows``, deferred rows dropped,
a step where vLLM ran no drafter, a request that is gapped: :mod:`falcon_vllm.core.lookup`), the blocks holding those
positions have target K/V but no drafter K/V.  A later request with the same prefix would hit them and draft over
K/V that was never written.  So the runner records those blocks here (:func:`mark`) and, before each scheduling
step, the scheduler evicts them from the prefix cache (``KVCacheManager.evict_blocks``: running requests keep
them, new requests recompute them, drafter K/V included).

Runner and scheduler share this module where they share a process: vLLM's engine core runs both with one worker
(tensor parallel 1, the engine-core process or the in-process engine).  With several worker processes (TP > 1) the
scheduler never sees the marks; such blocks then cost acceptance, never output.
"""

from __future__ import annotations

DIRTY: set[int] = set()  # block ids (the scheduler's) whose drafter K/V some positions lack, not yet evicted
evicted = 0  # blocks evicted so far (tests read it)


def blocks_of(runner, req_id: str, start: int, end: int | None = None) -> list[int]:
    """The ids of the blocks of request ``req_id`` holding positions ``start ..`` (to ``end``, else its last block)
    in the drafter's KV-cache group."""
    state = getattr(runner, "requests", {}).get(req_id)
    drafter = getattr(runner, "drafter", None)
    gid = max(0, int(getattr(drafter, "kv_cache_gid", 0) or 0))
    if state is None or start < 0:
        return []
    ids = state.block_ids[gid]
    bs = runner.kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size
    last = len(ids) if end is None else min(len(ids), (end + bs - 1) // bs)
    return list(ids[start // bs:last])


def mark(block_ids) -> None:
    DIRTY.update(int(b) for b in block_ids)


def evict(scheduler) -> None:
    """Before a scheduling step: evict the marked blocks from the prefix cache."""
    global evicted
    if DIRTY:
        manager = scheduler.kv_cache_manager
        # (a mark left by an engine of this process that has shut down may name a block this pool lacks)
        ids = {b for b in DIRTY if b < len(manager.block_pool.blocks)}
        DIRTY.clear()
        manager.evict_blocks(ids)
        evicted += len(ids)


def _schedule(orig):
    def schedule(self, *args, **kwargs):
        evict(self)
        return orig(self, *args, **kwargs)

    return schedule


def install() -> None:
    from falcon_vllm.vllm import patches

    patches.wrap(patches.resolve("vllm.v1.core.sched.scheduler:Scheduler"), "schedule", _schedule)
