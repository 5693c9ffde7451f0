"""An in-process vLLM ``LLM`` (demo, gen-data, benchmarks, tests): its teardown and its spec-decode counters.

No vLLM import at module level: the counter helpers serve the reference engine's rows of the benchmark too.
"""

from __future__ import annotations

PREFIX = "vllm:spec_decode_"
# vLLM's spec-decode counters (``LLM.get_metrics()`` names without PREFIX): drafts (one per request and
# step), draft tokens, accepted draft tokens, and accepted tokens per draft position (tree: per depth)
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"


def shutdown_llm(llm) -> None:
    """Shut an in-process engine down completely, so that another can start in this process: its
    engine core (which releases the model and KV cache), then garbage and vLLM's distributed state.
    ``llm`` None (an engine that failed to start): the clean-up only."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
    gc.collect()
    cleanup_dist_env_and_memory()


def empty_counters() -> dict:
    return {**dict.fromkeys(COUNTERS, 0), PER_POS: []}


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters of ``llm``, cumulative since it started (summed over engines):
    ``{"num_drafts", "num_draft_tokens", "num_accepted_tokens": int, "num_accepted_tokens_per_pos": [int]}``,
    zeros without speculation."""
    out = empty_counters()
    for m in llm.get_metrics():
        key = m.name[len(PREFIX):] if m.name.startswith(PREFIX) else None
        if key in COUNTERS:
            out[key] += int(m.value)
        elif key == PER_POS:
            out[key] = _add([int(v) for v in m.values], out[key])
    return out


def counter_delta(after: dict, before: dict) -> dict:
    """``after - before`` of two :func:`spec_counters` snapshots (per position: over ``after``'s
    positions, since a tree's list grows as deeper paths are accepted)."""
    return {k: _add(after[k], before[k], -1) if isinstance(after[k], list) else after[k] - before[k] for k in after}


def _add(a: list, b: list, sign: int = 1) -> list:
    """``a + sign * b`` element-wise over a's positions (b padded with zeros)."""
    return [x + sign * y for x, y in zip(a, list(b) + [0] * (len(a) - len(b)))]
