"""The contract between the drafting core and a model runner: what an adapter of
:class:`~falcon_vllm.core.drafting.FalconDrafting` provides.

The V1 runner's :class:`falcon_vllm.vllm.proposer.FalconProposer` and Model Runner V2's
:class:`falcon_vllm.vllm.v2.speculator.FalconSpeculator` are the two adapters; ``tests/test_plan.py`` checks that each
defines every method here.  ``ctx`` is the adapter's own per-step object (V1: the step's common attention metadata;
V2: its input batch), passed back to it unread.  Shapes: B requests, block size k, hidden size H.
"""

from __future__ import annotations

from typing import Protocol

import torch


class RunnerAdapter(Protocol):
    """Every adapter: the drafter's input rows, and the drafter passes the core asks for."""

    # the drafter's input rows: at a step's start rows 0 .. N-1 hold its chunk in EAGLE's shifted layout
    input_ids: torch.Tensor      # [M]
    positions: torch.Tensor      # [M]
    hidden_states: torch.Tensor  # [M, H]
    device: torch.device
    block_size: int
    max_model_len: int

    def _relaxed_block_inputs(self, ctx, last: torch.Tensor, B: int):
        """The relaxed block's inputs (``FalconDrafting.block_inputs`` on the runner's query starts)."""

    def _chunk_pass(self, ctx, num_tokens: int, positions: torch.Tensor) -> None:
        """The causal pass over the chunk's rows (writes the drafter's K/V)."""

    def _block_pass(self, ctx, ids, feats, positions, writes, extra_len: int) -> torch.Tensor:
        """Non-causal k-row blocks, one per request (laid out by ``plan_block``) -> rows [B, k, H]."""

    def _draft(self, rows: torch.Tensor, sampling, probs: list | None = None, conf: list | None = None) -> torch.Tensor:
        """The drafter's tokens from rows [B, k, H] -> [B, k] (argmax, or drawn at each request's temperature)."""

    def _draft_tree(self, ctx, rows: torch.Tensor, positions: torch.Tensor, K: int) -> torch.Tensor:
        """Tree mode: the tree's nodes from the relaxed block's rows -> [B, K]."""

    def _tree_block_pass(self, attn, ids, feats, positions) -> torch.Tensor:
        """One SAR tree pass under ``attn`` (a ``DraftTreeAttention``)."""

    def _topk(self, rows: torch.Tensor, topk: int) -> torch.Tensor:
        """The drafter's top-k token ids of each row."""


class FusingAdapter(RunnerAdapter, Protocol):
    """A runner whose one drafter pass can hold causal chunks and non-causal blocks (``fuse_chunk``: the V1 runner on
    CPU) also runs the chunk pass and the relaxed block as one pass, defers a step's rows, and feeds level offsets."""

    def _fused_pass(self, ctx, num_tokens: int, last: torch.Tensor, ids, feats, positions, known) -> torch.Tensor:
        """The chunk pass and pass 1 in one drafter pass (laid out by ``plan_fused``) -> rows [B, k, H]."""

    def _defer(self, ctx, last: torch.Tensor, B: int) -> bool:
        """Keep the step's verified rows for the next drafter pass instead of running one (``defer_rows_of``)."""

    def _set_offsets(self, offsets: torch.Tensor | None) -> None:
        """The level offsets of the next pass's rows (level-embedding drafters)."""
