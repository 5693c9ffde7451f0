"""The schema of Falcon's speculative-config keys and of a drafter's ``serving.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


# serving.json's prompt-lookup keys (falcon_vllm.vllm.options validates them)
LOOKUP_KEYS = ("prompt_lookup_min", "prompt_lookup_max", "falcon_tokens", "lookup_tokens")
STORE_KEYS = ("datastore", "datastore_tokens", "datastore_max_batch")
LOOKUP_BATCH_KEY = "falcon_max_batch"  # the drafter's chain only in steps of at most this many requests


@dataclass(frozen=True)
class TreeFile:
    """A JSON file written by ``falcon-vllm tune-tree`` (``main`` below), or a drafter's ``serving.json``,
    which holds either such a file or ``{"num_speculative_tokens": n}`` (a chain), optionally with vLLM's
    ``"num_speculative_tokens_per_batch_size": [[lo, hi, K], ...]`` (the chain's length per batch size; with
    ``"num_speculative_tokens_per_batch_size_by_cpu": {capability: schedule}``, a schedule for CPUs of that
    capability instead), vLLM's
    ``"draft_sample_method"`` (with ``"draft_temperature_scale"``) and the prompt-lookup keys
    (``prompt_lookup_min``, ``prompt_lookup_max``, ``falcon_tokens``, ``lookup_tokens``, ``datastore``,
    ``datastore_tokens``, ``datastore_max_batch``, ``falcon_max_batch``)."""
    tuned: bool                            # a tune-tree file (it has "paths" or "by_batch_size")
    paths: list | None                     # its main tree (the largest one: vLLM's K)
    by_batch_size: list[tuple[int, list]]  # (batch size, its tree's paths; [] = no speculation), ascending
    num_speculative_tokens: int | None     # serving.json's chain form
    chain_schedule: list | None = None     # serving.json's chain form: K per batch-size range
    chain_schedule_by_cpu: dict | None = None  # serving.json's chain form: {CPU capability: schedule} (it wins there)
    lookup: dict = field(default_factory=dict)  # serving.json's chain form: its prompt-lookup keys, as given
    draft_sample_method: str | None = None  # serving.json's chain form: how the chain's drafts are drawn
    draft_temperature_scale: float | None = None  # serving.json's chain form: sampled drafts' temperature factor


def read_tree_file(path: str) -> TreeFile:
    """Parse a tune-tree file (or ``serving.json``, or a plain tree file: a JSON list of paths or
    ``{"tree": paths}``); any other JSON gives an empty, untuned result."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"falcon-vllm: {path} is not valid JSON: {e}") from None
    plain = data if isinstance(data, list) else None
    if not isinstance(data, dict):
        data = {}
    by, n = data.get("by_batch_size") or {}, data.get("num_speculative_tokens")
    return TreeFile(tuned="paths" in data or "by_batch_size" in data, paths=data.get("paths", data.get("tree", plain)),
                    by_batch_size=sorted((int(b), r.get("paths") or []) for b, r in by.items()),
                    num_speculative_tokens=n if isinstance(n, int) else None,
                    chain_schedule=data.get("num_speculative_tokens_per_batch_size"),
                    chain_schedule_by_cpu=data.get("num_speculative_tokens_per_batch_size_by_cpu"),
                    lookup={key: data[key] for key in LOOKUP_KEYS + STORE_KEYS + (LOOKUP_BATCH_KEY,) if key in data},
                    draft_sample_method=data.get("draft_sample_method"),
                    draft_temperature_scale=data.get("draft_temperature_scale"))
