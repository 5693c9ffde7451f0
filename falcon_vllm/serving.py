"""What a Falcon drafter serves with: the resolved options, one typed, frozen object that every runner reads.

:func:`falcon_vllm.vllm.options.resolve_falcon_config` builds a :class:`Serving` once, in the process that builds
vLLM's config, from the user's speculative config, the drafter's ``serving.json`` and its checkpoint.  It crosses
to the workers as flat keys in the draft model's ``hf_config.falcon`` (:meth:`Serving.section`, beside the
checkpoint's own keys: vLLM hands a plain dict to every process), and each worker reads it back once
(:meth:`Serving.from_section`).  Key names are the user's (:mod:`falcon_vllm.schema`); this module is the only
reader and writer of them.  No vLLM import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Lookup:
    """Prompt lookup first, the drafter's chain otherwise (:mod:`falcon_vllm.core.lookup`)."""

    prompt_lookup_min: int
    prompt_lookup_max: int
    drafter_tokens: int                   # the drafter's chain length where a request has no lookup draft
    lookup_tokens: int                    # a lookup draft's starting length (doubles while accepted whole)
    drafter_max_batch: int | None = None  # the drafter's chain only in steps of at most this many requests
    datastore: str | None = None          # the target's stored answers (absolute path), looked up next
    datastore_tokens: int | None = None
    datastore_max_batch: int | None = None


@dataclass(frozen=True)
class Serving:
    """A Falcon drafter's serving options, resolved (the drafter's block layout included)."""

    k: int                                  # the drafter's block size (its checkpoint)
    block_order: str = "forward"            # "reversed": a block's last row outputs level 1
    level_embedding: bool = False           # the drafter reads its rows' offsets inside their k-blocks
    mode: str = "chain"                     # "chain" or "tree"
    num_speculative_tokens: int | None = None
    draft_gemm_dtype: str | None = None     # None: FALCON_VLLM_DRAFT_GEMM_DTYPE, else "auto"
    draft_confidence: float = 0.0           # a chain draft stops where the drafter's confidence falls below this
    draft_temperature_scale: float = 1.0    # sampled drafts at this times the request's temperature
    tree: list | None = None                # tree mode: the tree's paths
    tree_name: str | None = None
    subtrees: dict | None = None            # tree mode from a tune-tree file: {nodes: paths} per batch size
    lookup: Lookup | None = None

    @property
    def ragged(self) -> str | None:
        """What gives requests drafts of different lengths in one step (which async scheduling cannot take)."""
        ragged = [name for name, on in (("prompt lookup (prompt_lookup_max)", self.lookup is not None),
                                        ("draft_confidence", bool(self.draft_confidence))) if on]
        return " and ".join(ragged) or None

    # ------------------------------------------------------------------ the wire format
    _DRAFTER = ("k", "block_order", "level_embedding")  # the checkpoint's keys, already in its section

    def section(self) -> dict:
        """The flat keys to merge into the drafter's ``hf_config.falcon`` (options left at their defaults are
        omitted; the drafter's own keys come from its checkpoint)."""
        out: dict = {"mode": self.mode, "num_speculative_tokens": self.num_speculative_tokens}
        for name in ("draft_gemm_dtype", "draft_confidence", "draft_temperature_scale", "tree", "tree_name",
                     "subtrees"):
            value, default = getattr(self, name), _DEFAULTS[name]
            if value is not None and value != default:
                out[name] = value
        if self.lookup is not None:
            out |= {k: v for k, v in dataclasses.asdict(self.lookup).items() if v is not None}
        return out

    @classmethod
    def from_section(cls, falcon: dict) -> Serving:
        """The options from a drafter's ``hf_config.falcon`` (its checkpoint's keys and :meth:`section`'s)."""
        lookup = None
        if falcon.get("prompt_lookup_max"):
            lookup = Lookup(**{f.name: falcon.get(f.name) for f in dataclasses.fields(Lookup)})
        scalar = {f.name: falcon[f.name] for f in dataclasses.fields(cls)
                  if f.name in falcon and f.name != "lookup"}
        for name in ("draft_confidence", "draft_temperature_scale"):
            if name in scalar:
                scalar[name] = float(scalar[name])
        return cls(**{**scalar, "k": int(falcon.get("k", 1)), "level_embedding": bool(falcon.get("level_embedding")),
                      "block_order": falcon.get("block_order") or "forward", "lookup": lookup})


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Serving)}
