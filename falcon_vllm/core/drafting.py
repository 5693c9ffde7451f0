"""The Falcon drafting core: one step's SAR drafter passes, planned on plain tensors, for any runner.

Nothing here reads a model runner, its input batch or vLLM's attention metadata.  A runner adapter (the V1
:class:`falcon_vllm.vllm.proposer.FalconProposer`; a Model Runner V2 speculator) subclasses
:class:`FalconDrafting`, hands it the step's rows and runs the drafter where it is told to.  The algorithm is
described in ``docs/design.md`` ("The drafting core"); shapes use B requests, block size k, hidden size H.

What the adapter holds (attributes the core reads and writes):

* ``input_ids [M]``, ``positions [M]``, ``hidden_states [M, H]``: the drafter's input rows.  At a step's start
  rows ``0 .. N-1`` hold its chunk in EAGLE's shifted layout (row j: token ``x_{j+1}``, target feature ``f_j``),
  each request's rows consecutive from ``query_start[b]`` to ``last[b]``, the row of its last committed
  position (vLLM's padded drafter batch may leave rejected rows after it).
* ``device``, ``block_size``, ``max_model_len``.

What it calls: ``init_drafting(falcon)`` and ``init_stash(...)`` once; per step it plans
(:func:`falcon_vllm.core.plan.plan_step`, kept in ``step_plan``), then ``chain_budget(K)`` and
``draft_step(ctx, K, N, last, B, sampling, want_probs) -> tokens [B, <=K]``; ``cut(chain)`` gives
each request's ``draft_confidence`` length; ``keep_rows`` keeps a step's rows while drafting is off.  The
stash's ``dropped`` slots name the requests whose rows were lost (the adapter marks them gapped).
``draft_probs`` holds a sampled chain's distributions [B, K, V] for the rejection sampler.  A chain step whose
chunk pass has run (Model Runner V2's) splits in two: ``step_slots(req_ids)`` on the host, then
``chain_program(ctx, query_start, last, slots, K)``, which reads nothing on the host and has static shapes.

What it provides, the drafter's passes (:class:`falcon_vllm.core.adapter.RunnerAdapter`; ``ctx`` is the adapter's
own per-step object, passed back unread):

* ``_relaxed_block_inputs(ctx, last, B) -> BlockInputs``: usually ``block_inputs(query_start, last, req_ids)``.
* ``_fused_pass(ctx, N, last, ids, feats, positions, known) -> rows [B, k, H]``: one pass laid out by
  ``plan_fused(...)`` (a :class:`FusedPass`), outputs cut by ``block_outputs``.
* ``_chunk_pass(ctx, N, positions)``: the causal pass over the chunk rows as they lie
  (level offsets: ``chunk_offsets``).
* ``_block_pass(ctx, ids, feats, positions, writes, extra_len) -> rows [B, k, H]``: non-causal k-row blocks,
  laid out by ``plan_block(...)`` (a :class:`BlockPass`), counted in ``passes``.
* ``_draft_tree(ctx, rows, positions, K) -> nodes [B, K]``: usually ``draft_tree(...)``, whose passes run
  through ``_tree_block_pass(attn, ids, feats, positions)`` (counted in ``passes``) and ``_topk(rows, topk)``.
* ``_draft(rows, sampling, probs, conf) -> tokens [B, k]``: the drafter's logits through ``draft_tokens``,
  which samples with ``sample_logits(logits, sampling) -> (ids, probs)``.
* ``_defer(ctx, last, B) -> bool``: usually ``defer_rows_of(starts, last, req_ids)``.
* ``_set_offsets(offsets [n] | None)``: the drafter's level offsets of the next pass's rows.
* ``blocks_of(req_id, first, stop)``: the KV-cache block ids of a request's positions ``first .. stop-1``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import NamedTuple

import torch

from falcon_vllm.datastore import Datastore
from falcon_vllm.serving import Serving
from falcon_vllm.core import lookup, plan, tree_draft
from falcon_vllm.core.lookup import LookupState
from falcon_vllm.core.stash import BlockInputStash

logger = logging.getLogger(__name__)
PADDING_SLOT_ID = -1  # the KV-cache writers skip negative slots
SAMPLING_EPS = 1e-5   # vLLM's: a temperature below it is greedy


class BlockInputs(NamedTuple):
    """The relaxed block of a step: each request's last k committed positions."""

    ids: torch.Tensor        # [B, k] input tokens
    feats: torch.Tensor      # [B, k, H] input features
    positions: torch.Tensor  # [B, k] long, consecutive (< 0 before the sequence start)
    known: torch.Tensor      # [B, k] bool: inputs known (this chunk or the stash); a suffix of each row


@dataclasses.dataclass
class FusedPass:
    """One drafter pass of G query groups: the causal chunk groups, then the B relaxed blocks (non-causal)."""

    num_rows: int                 # n: rows of the pass (its inputs are in the drafter's rows 0 .. n-1)
    num_chunk_rows: int           # nc: the chunk groups' rows; the blocks are rows nc .. n-1
    query_start_cpu: torch.Tensor  # [G+1] int32 (host) group starts
    max_query_len: int
    seq_lens: torch.Tensor        # [G] context length of each group (its last row's position + 1)
    causal: torch.Tensor          # [G] int32: 1 causal chunk group, 0 relaxed block
    block_table: torch.Tensor     # [G, blocks] each group's request's block table row
    chunked: torch.Tensor         # [G - B] long (host): the request of each chunk group
    slot_mapping: torch.Tensor    # [n] KV slot of each row (PADDING_SLOT_ID: no write)
    positions: torch.Tensor       # [n] position of each row
    offsets: torch.Tensor | None  # [n] level offsets (None: no level embedding)


@dataclasses.dataclass
class BlockPass:
    """One drafter pass of B non-causal k-row blocks."""

    num_rows: int                  # n = B * k
    query_start_cpu: torch.Tensor  # [B+1] int32 (host)
    seq_lens: torch.Tensor         # [B] int32
    slot_mapping: torch.Tensor     # [n]
    positions: torch.Tensor        # [n]
    offsets: torch.Tensor | None   # [n]


class FalconDrafting:
    """The drafting algorithm and its state; see the module docstring for what a subclass provides."""

    def init_drafting(self, falcon: Serving | None) -> None:
        """The options and counters of the drafter's serving options (None: not a Falcon drafter)."""
        self.falcon = falcon
        self.k = falcon.k if falcon else 1
        # block_order "reversed": a block's last row outputs level 1 (FalconDrafter.forward's level_order)
        self.reversed_blocks = bool(falcon) and falcon.block_order == "reversed"
        # level embedding: each pass tells the drafter its rows' offsets inside their k-blocks (_set_offsets)
        self.level_embedding = bool(falcon) and falcon.level_embedding
        self.steps = 0   # steps that drafted tokens
        self.passes = 0  # drafter passes that produced draft tokens (relaxed block + block passes)
        self.skipped_steps = 0  # steps with no drafts scheduled (the runner's fast path skipped drafting)
        self.gap_steps = 0  # steps whose every request has a drafter-KV gap: lookup drafts only, no drafter pass
        self.lookup_only_steps = 0  # steps past falcon_max_batch: lookup drafts only, the rows kept, no drafter pass
        self.deferred_steps = 0  # steps whose drafter pass was deferred
        self.step_plan = None   # this step's plan (core.plan.StepPlan), set by the runner before draft_step
        self.tree = None        # tree mode's DecodingTree (None: chain mode)
        self.tree_state = None  # tree mode's state (tree_draft.TreeState)
        self.lookup: LookupState | None = None  # prompt lookup first (chain mode; falcon_vllm.core.lookup)
        # sampled drafts (draft_sample_method "probabilistic"): the drafter's temperature over the request's
        self.draft_temperature_scale = falcon.draft_temperature_scale if falcon else 1.0
        # draft_confidence: a chain draft stops where the drafter's probability of it so far falls below this
        self.draft_confidence = falcon.draft_confidence if falcon else 0.0
        self.proposed = False  # the runner asked for this step's drafts (set by the runner hook)
        self.draft_lengths: torch.Tensor | None = None  # [B] this step's chain lengths under draft_confidence
        self.last_confidence: torch.Tensor | None = None  # [B, K]: the drafter's probability of each chain token
        self.draft_probs: torch.Tensor | None = None  # [B, K, V]: a sampled chain's distributions (else None)
        # chunk pass + relaxed block in one drafter pass (set by the adapter where its attention takes per-request
        # causal flags); prune_chunk: it runs only the chunk rows before each block (False: all, for A/Bs)
        self.fuse_chunk = False
        self.prune_chunk = True
        # a step whose drafts all come from prompt lookup runs no drafter pass: its verified rows wait (at most
        # defer_rows per request) for the next pass, which runs them first (False: every step runs one, for A/Bs)
        self.defer_chunk = True
        self.defer_rows = 32
        # a step with drafting off (lookup mode) keeps its verified rows, at most gap_rows per request, for the next
        # drafter pass, so that a request's drafter K/V has no gap when drafting resumes (keep_rows; 0: off).
        # Not more: catching up a whole prompt prefilled with drafting off cost more than it bought
        # (ab_gap_rows_b4_*_spr.md)
        self.gap_rows = 64
        self._pending_blocks: dict[int, set[int]] = {}  # stash slot -> the blocks of its pending rows

    def init_lookup(self) -> None:
        """Prompt lookup (and its datastore) from the ``falcon`` section, when it asks for it."""
        f = self.falcon.lookup
        if f is not None:
            self.lookup = LookupState(f.prompt_lookup_min, f.prompt_lookup_max, f.drafter_tokens, f.lookup_tokens,
                                      Datastore.load(f.datastore).build() if f.datastore else None,
                                      f.datastore_tokens, f.datastore_max_batch, f.drafter_max_batch)
            lookup.warm_up()

    def init_stash(self, max_batch: int, hidden_size: int, device, dtype, ids_dtype) -> None:
        """The per-request stash of block inputs and pending rows (slots for twice ``max_batch`` requests)."""
        self._stash = BlockInputStash(2 * max_batch, self.k, hidden_size, device, dtype, ids_dtype=ids_dtype)

    def blocks_of(self, req_id: str, first: int, stop: int):
        """The KV-cache block ids of request ``req_id``'s positions ``first .. stop-1`` (the adapter's)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ one step
    def chain_budget(self, K: int) -> int:
        """The drafter's tokens this step of K speculative tokens (prompt lookup caps the drafter's chain)."""
        return plan.chain_budget(K, self.lookup)

    def draft_step(self, ctx, K: int, num_tokens: int, last: torch.Tensor, B: int, sampling=None,
                   want_probs: bool = False) -> torch.Tensor:
        """Draft K tokens per request over a step's chunk (rows ``0 .. num_tokens-1``; ``last`` [B] each
        request's last valid row).  Returns int64 tokens [B, K] (chain: fewer where every draft stopped early;
        tree: the node tokens), or [B, 0] when prompt lookup serves every request.  ``want_probs``: a sampled
        chain hands its distributions on (``draft_probs``)."""
        last = last.long()
        self.draft_lengths = self.draft_probs = None
        ids, feats, positions, known = self._relaxed_block_inputs(ctx, last, B)
        step_plan, self.step_plan = self.step_plan, None  # the runner's plan of this step (None: draft)
        drafting = step_plan is None or not step_plan.all_matched  # else every request has a lookup draft
        fused = self._fuses(num_tokens, B)
        if fused and not drafting and self.defer_chunk and self._defer(ctx, last, B):
            self.deferred_steps += 1  # prompt lookup serves every request: the next drafter pass writes these rows
            return torch.empty(B, 0, dtype=torch.int64, device=self.device)
        if fused:
            # chunk pass and pass 1 (the relaxed block -> draft tokens 1..k) in one drafter pass
            rows = self._fused_pass(ctx, num_tokens, last, ids, feats, positions, known)
            self.passes += drafting
        else:
            # chunk pass: stock causal EAGLE pass over every verified token (writes the drafter KV)
            self._chunk_pass(ctx, num_tokens, positions)
            rows = None
        if not drafting:
            return torch.empty(B, 0, dtype=torch.int64, device=self.device)
        self.steps += 1
        if rows is None:  # pass 1: the relaxed block -> draft tokens 1..k
            rows = self._block_pass(ctx, ids, feats, positions, writes=known, extra_len=0)  # [B, k, H]
        if self.tree is not None:
            return self._draft_tree(ctx, rows, positions, K)
        return self._draft_chain(ctx, rows, positions, K, sampling, want_probs)

    def chain_program(self, ctx, query_start: torch.Tensor, last: torch.Tensor, slots: torch.Tensor, K: int,
                      valid: torch.Tensor | None = None, sampling=None, want_probs: bool = False,
                      early_stop: bool = False) -> torch.Tensor:
        """The device part of a chain step whose chunk pass has run: the relaxed block's inputs gathered from the
        chunk rows and the stash (``slots`` [B] from ``step_slots``), its pass, then the chain's passes and draws
        -> tokens [B, K].  It reads nothing on the host and every shape follows from B, k and K: what a CUDA graph
        captures (``tests/test_drafting.py`` runs it on the meta device, where any host read fails).  ``valid``
        [B] bool: the real rows of a batch padded to a captured size; padded rows write no K/V and no stash row a
        request owns (their slot is the stash's scratch slot).  ``early_stop``: with ``draft_confidence``, no pass
        once every request's draft has stopped, a host read (captured graphs run every pass)."""
        self.draft_lengths = self.draft_probs = None
        block = self.gather_block_inputs(query_start, last, slots, valid)
        rows = self._block_pass(ctx, block.ids, block.feats, block.positions, writes=block.known, extra_len=0)
        return self._draft_chain(ctx, rows, block.positions, K, sampling, want_probs, valid, early_stop)

    def _draft_chain(self, ctx, rows, positions, K: int, sampling, want_probs: bool,
                     valid: torch.Tensor | None = None, early_stop: bool = True) -> torch.Tensor:
        """Draft tokens 1..k from the relaxed block's rows [B, k, H], then passes 2..: one k-token block per
        request on top of the previous one, while some request's draft is still going (``draft_confidence``;
        ``early_stop``).  ``valid`` [B]: the rows whose passes write K/V (None: all)."""
        k = self.k
        writes = None if valid is None else valid[:, None].expand(-1, k)
        # sampled drafts: tokens drawn from the drafter at each request's temperature, their distributions handed
        # to the rejection sampler; else the drafter's argmax
        probs = [] if want_probs else None
        conf = [] if self.draft_confidence else None  # the drafter's probability of each drafted token
        drafted = [self._draft(rows, sampling, probs, conf)]
        next_pos = positions[:, -1:] + 1 + torch.arange(k, device=positions.device)[None]  # [B, k]
        for q in range(1, math.ceil(K / k)):
            if early_stop and conf is not None and not bool(
                    (torch.cat(conf, 1).prod(1) >= self.draft_confidence).any()):
                break  # every request's draft already stops: no further pass
            rows = self._block_pass(ctx, drafted[-1], rows, next_pos + k * (q - 1), writes=writes, extra_len=q * k)
            drafted.append(self._draft(rows, sampling, probs, conf))
        if self.steps == 1:
            logger.info("falcon-vllm: drafted K=%d tokens in %d drafter passes (k=%d)", K, math.ceil(K / k), k)
        if probs is not None:
            self.draft_probs = torch.cat(probs, dim=1)[:, :K].contiguous()
        if conf is not None:
            self.last_confidence = torch.cat(conf, 1)[:, :K]
            self.draft_lengths = (self.last_confidence.cumprod(1) >= self.draft_confidence).sum(1)  # [B], on device
        return torch.cat(drafted, dim=1)[:, :K].to(torch.int64)

    def cut(self, chain: torch.Tensor) -> list[list[int]]:
        """This step's chain drafts [B, <=K] as per-request lists, each cut to its ``draft_confidence`` length."""
        rows = chain.tolist()
        if self.draft_lengths is not None:
            rows = [r[:n] for r, n in zip(rows, self.draft_lengths.tolist())]
            self.draft_lengths = None
        return rows

    def take_proposed(self) -> bool:
        """Whether the runner asked for drafts since the last call (it skips the drafter near max_model_len)."""
        proposed, self.proposed = self.proposed, False
        return proposed

    # ------------------------------------------------------------------ the relaxed block and the stash
    def block_inputs(self, query_start: torch.Tensor, last: torch.Tensor, req_ids: list[str | None]) -> BlockInputs:
        """The relaxed block's inputs, each request's last k committed positions: rows of this chunk where it
        reaches back that far (``query_start`` [B] each request's first row), else the stash's rows of earlier
        steps.  ``last`` [B] each request's last valid row; ``req_ids`` key the stash (None: no request)."""
        return self.gather_block_inputs(query_start, last, self.step_slots(req_ids, last.device))

    def step_slots(self, req_ids: list[str | None], device) -> torch.Tensor:
        """The host part of a step's relaxed block: each request's stash slot [B] (None: the scratch slot, a
        padded row's); pending rows of requests outside the step are dropped."""
        slots = self._step_slots = self._stash.slots(req_ids, device)
        if self._stash.pending:
            self._stash.retain(slots.tolist())
        return slots

    def gather_block_inputs(self, query_start: torch.Tensor, last: torch.Tensor, slots: torch.Tensor,
                            valid: torch.Tensor | None = None) -> BlockInputs:
        """The device part of :meth:`block_inputs`: gathers from the chunk rows, filled from and saved to the stash
        at ``slots``; no host read.  ``valid`` [B] bool (None: every row): a padded row's inputs count as unknown,
        so its relaxed block writes no K/V."""
        k = self.k
        offs = torch.arange(k - 1, -1, -1, device=last.device)              # k-1 .. 0
        idx = last[:, None] - offs[None]                                      # [B, k]
        known = idx >= query_start.long()[:, None]
        safe = torch.where(known, idx, last[:, None].expand_as(idx))
        ids = self.input_ids[safe]                                            # gathers copy
        feats = self.hidden_states[safe]
        positions = self.positions[last].long()[:, None] - offs[None]
        if k > 1:
            known = self._stash.fill(slots, ids, feats, positions, known)
            self._stash.update(slots, ids, feats, positions, known)  # (a padded row: the scratch slot only)
        if valid is not None:  # a padded row's rows, from the chunk or the scratch slot, are not its own
            known = known & valid[:, None]
        return BlockInputs(ids, feats, positions, known)

    def _fuses(self, num_tokens: int, B: int) -> bool:
        """Whether the chunk pass and the relaxed block run as one pass (they, and the rows deferred or kept by
        earlier steps, which it runs first, fit the drafter's rows); pending rows a step cannot run are dropped."""
        pending = self._stash.total_rows(self._step_slots.tolist()) if self._stash.pending else 0
        fused = self.fuse_chunk and num_tokens + B * self.k + pending <= self.input_ids.shape[0]
        if pending and not fused:  # only a fused pass runs pending rows: whose rows are dropped have a gap
            for s in self._step_slots.tolist():
                self._stash._drop(s)  # the adapter marks the owners gapped and their blocks (note_drops)
        return fused

    def defer_rows_of(self, starts: list[int], last: torch.Tensor, req_ids: list[str | None]) -> bool:
        """Keep each request's verified rows (chunk rows ``starts[b] .. last[b]``) as pending rows for the next
        drafter pass instead of running one now; False (nothing kept) when one would exceed ``defer_rows``."""
        # a row's level offset: from its request's end now, as this step's pass would give it
        rows = [(self.input_ids[a:e + 1].clone(), self.hidden_states[a:e + 1].clone(),
                 self.end_offsets(self.positions[a:e + 1], int(self.positions[e])), int(self.positions[a]))
                for a, e in zip(starts, last.tolist())]
        if not self._stash.defer(self._step_slots.tolist(), rows, self.defer_rows):
            return False
        for s, r, row in zip(self._step_slots.tolist(), req_ids, rows):
            self._remember_blocks(s, r, row[3], len(row[0]))
        return True

    def keep_rows(self, slot: int, req_id: str, ids: torch.Tensor, feats: torch.Tensor, first: int) -> bool:
        """A step with drafting off: keep one request's verified rows (ids [n], feats [n, H] at positions
        ``first ..``) for the next drafter pass; False when they do not fit (its drafter K/V then has a gap)."""
        n = len(ids)
        piece = (ids, feats, self.end_offsets(torch.arange(first, first + n), first + n - 1), first)
        if not self._stash.keep(slot, piece, self.gap_rows):
            return False
        self._remember_blocks(slot, req_id, first, n)
        return True

    def _remember_blocks(self, slot: int, req_id: str | None, first: int, n: int) -> None:
        """The blocks of a pending piece's rows (``first .. first+n``): marked if the piece is dropped unrun."""
        if req_id is not None:
            self._pending_blocks.setdefault(slot, set()).update(self.blocks_of(req_id, first, first + n))

    def _take_pending(self, query_start: torch.Tensor, positions: torch.Tensor):
        """The pending rows this step's fused pass runs before its chunk (``BlockInputStash.take``), or None."""
        if not self._stash.pending:  # rows deferred by steps served by prompt lookup alone run first
            return None
        B = positions.shape[0]
        starts = self.positions[query_start[:B].long()].tolist()
        pend = self._stash.take(self._step_slots.tolist(), starts, positions[:, 0].tolist())
        for s in set(self._step_slots.tolist()) - self._stash.dropped:  # run now: written
            self._pending_blocks.pop(s, None)
        return pend

    # ------------------------------------------------------------------ pass layouts
    def plan_fused(self, num_tokens: int, query_start: torch.Tensor, last: torch.Tensor, block: BlockInputs,
                   chunk_slots: torch.Tensor, chunk_seq_lens: torch.Tensor, block_table: torch.Tensor) -> FusedPass:
        """Lay out the chunk pass and the relaxed block as one pass and write its rows into the drafter's rows.

        ``query_start`` [B+1] the chunk's request starts; ``chunk_slots`` [N] and ``chunk_seq_lens`` [B] the
        chunk's KV slots and context lengths; ``block_table`` [>=B, blocks].  Per request, the chunk rows before
        its relaxed block run as a causal group (a request with none has no group), pending rows first; the
        chunk rows inside the block and after it (vLLM's padded drafter batch) would write nothing and their
        outputs are unused, so they do not run (``prune_chunk`` False: they run, writing nothing).
        """
        ids, feats, positions, known = block
        B, k = ids.shape
        dev = ids.device
        row = torch.arange(num_tokens, device=dev)
        req = self._row_requests(query_start, row, B)
        before_block = row <= last[req] - k
        table = block_table[:B]
        if self.prune_chunk:
            keep = torch.nonzero(before_block).squeeze(1)       # chunk rows before their request's block
            c_slots = chunk_slots[keep].long()
        else:  # every chunk row (for A/B measurements): those from the block on write no K/V
            keep = row
            c_slots = torch.where(before_block, chunk_slots[:num_tokens].long(), PADDING_SLOT_ID)
        c_req, c_ids, c_pos, c_feats = req[keep], self.input_ids[keep], self.positions[keep], self.hidden_states[keep]
        offsets = None
        if self.level_embedding:  # chunk rows: blocks aligned to each request's end, as the reference lays them out
            offsets = self.end_offsets(c_pos, positions[c_req, -1])
        pend = self._take_pending(query_start, positions)
        if pend is not None:
            p_req, p_ids, p_feats, p_offs, p_pos = (t.to(dev) for t in pend)
            order = torch.argsort(torch.cat([p_req, c_req]), stable=True)  # each request's rows in position order
            c_req = torch.cat([p_req, c_req])[order]
            c_ids = torch.cat([p_ids.to(c_ids.dtype), c_ids])[order]
            c_pos = torch.cat([p_pos.to(c_pos.dtype), c_pos])[order]
            c_feats = torch.cat([p_feats.to(c_feats.dtype), c_feats])[order]
            c_slots = torch.cat([self.kv_slots(table[p_req], p_pos[:, None]), c_slots])[order]
            if self.level_embedding:
                offsets = torch.cat([p_offs, offsets])[order]
        rows_per_req = torch.bincount(c_req, minlength=B).cpu()
        nc, n = c_req.numel(), c_req.numel() + B * k
        chunked = torch.nonzero(rows_per_req).squeeze(1)        # requests with a chunk group
        if nc and (self.prune_chunk or pend is not None):
            self.input_ids[:nc] = c_ids
            self.positions[:nc] = c_pos
            self.hidden_states[:nc] = c_feats
        block_slots = torch.where(known.reshape(-1), self.kv_slots(block_table, positions), PADDING_SLOT_ID)
        counts = torch.cat([rows_per_req[chunked], torch.full((B,), k, dtype=torch.long)])
        qsl_cpu = torch.zeros(len(counts) + 1, dtype=torch.int32)
        torch.cumsum(counts, 0, out=qsl_cpu[1:])
        chunk_idx = chunked.to(dev)
        block_lens = (positions[:, -1] + 1).clamp(1, self.max_model_len)
        chunk_lens = positions[chunk_idx, 0] if self.prune_chunk else chunk_seq_lens[chunk_idx]  # ends before its block
        flat_pos = positions.clamp(0, self.max_model_len - 1).reshape(-1)
        if self.level_embedding:
            offsets = torch.cat([offsets, self.block_offsets(B, dev)])
        self._set_rows(nc, ids, feats, flat_pos)
        return FusedPass(
            num_rows=n, num_chunk_rows=nc, query_start_cpu=qsl_cpu, max_query_len=int(counts.max()),
            seq_lens=torch.cat([chunk_lens.to(chunk_seq_lens.dtype), block_lens.to(chunk_seq_lens.dtype)]),
            causal=torch.cat([torch.ones(len(chunked), dtype=torch.int32), torch.zeros(B, dtype=torch.int32)]).to(dev),
            block_table=torch.cat([table[chunk_idx], table]), chunked=chunked,
            slot_mapping=torch.cat([c_slots, block_slots]), positions=torch.cat([c_pos.to(flat_pos.dtype), flat_pos]),
            offsets=offsets)

    def plan_block(self, block_table: torch.Tensor, ids, feats, positions, writes) -> BlockPass:
        """Lay out one non-causal k-token block per request and write its rows into the drafter's rows.

        ids [B, k]; feats [B, k, H]; positions [B, k] consecutive; writes [B, k] bool or None (rows whose KV is
        written; None = all); ``block_table`` [>=B, blocks].
        """
        B, k = ids.shape
        slot_mapping = self.kv_slots(block_table, positions)
        if writes is not None:
            slot_mapping = torch.where(writes.reshape(-1), slot_mapping, PADDING_SLOT_ID)
        flat_pos = positions.clamp(0, self.max_model_len - 1).reshape(-1)
        self._set_rows(0, ids, feats, flat_pos)
        return BlockPass(num_rows=B * k, query_start_cpu=torch.arange(0, B * k + 1, k, dtype=torch.int32),
                         seq_lens=(positions[:, -1] + 1).clamp(1, self.max_model_len).to(torch.int32),
                         slot_mapping=slot_mapping, positions=flat_pos, offsets=self.block_offsets(B, ids.device))

    def block_outputs(self, out: torch.Tensor, nb: int) -> torch.Tensor:
        """A pass's block rows [nb*k, H] -> [nb, k, H] in level order (``block_order`` "reversed": flipped)."""
        out = out.view(nb, self.k, -1)
        return out.flip(1) if self.reversed_blocks else out

    def chunk_offsets(self, query_start: torch.Tensor, num_tokens: int, positions: torch.Tensor):
        """Offsets of the step's chunk rows: blocks aligned to each request's end (its last committed position
        ``positions[:, -1]``), as the reference engine's chunk pass lays them out (None: no level embedding)."""
        if not self.level_embedding:
            return None
        req = self._row_requests(query_start, torch.arange(num_tokens, device=positions.device), positions.shape[0])
        return self.end_offsets(self.positions[:num_tokens], positions[req, -1])

    def block_offsets(self, nb: int, device) -> torch.Tensor | None:
        """Row offsets of ``nb`` k-row blocks laid out one after another (None: no level embedding)."""
        return torch.arange(self.k, device=device).repeat(nb) if self.level_embedding else None

    def end_offsets(self, pos: torch.Tensor, end) -> torch.Tensor:
        """Level offsets of rows at positions ``pos`` in k-blocks aligned to their request's last committed position
        ``end`` (a tensor per row, or an int)."""
        return (pos.long() - end - 1) % self.k

    @staticmethod
    def _row_requests(query_start: torch.Tensor, row: torch.Tensor, B: int) -> torch.Tensor:
        """The request (0..B-1) of each flat chunk row index in ``row`` (``query_start`` [B+1])."""
        return torch.searchsorted(query_start[1:B + 1].long(), row, right=True).clamp(max=B - 1)

    def kv_slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """positions [B, T] -> flat KV slots [B*T] (PADDING for positions outside [0, max_model_len))."""
        bs = self.block_size
        pos = positions.clamp(0, self.max_model_len - 1).long()
        blk = block_table.long().gather(1, (pos // bs).clamp(max=block_table.shape[1] - 1))
        slots = blk * bs + pos % bs
        outside = (positions < 0) | (positions >= self.max_model_len)
        return torch.where(outside, PADDING_SLOT_ID, slots).reshape(-1)

    def _set_rows(self, start: int, ids, feats, flat_pos) -> None:
        """Write block rows (ids [B, k], feats [B, k, H], flat positions) into the drafter's input rows at ``start``."""
        n = ids.numel()
        self.input_ids[start:start + n] = ids.reshape(-1).to(self.input_ids.dtype)
        self.positions[start:start + n] = flat_pos.to(self.positions.dtype)
        self.hidden_states[start:start + n] = feats.reshape(n, -1)

    # ------------------------------------------------------------------ draft tokens
    def draft_tokens(self, logits: torch.Tensor, B: int, head, sampling=None, probs: list | None = None,
                     conf: list | None = None, vocab_size: int | None = None) -> torch.Tensor:
        """The drafter's logits [B*k, V'] -> draft tokens [B, k] (target ids, by ``head.to_target_ids``).

        ``probs`` None: the drafter's argmax.  Else tokens sampled at each request's temperature
        (``sample_logits``: greedy requests keep the argmax; ``draft_temperature_scale`` scales the sampled rows'
        temperatures; in plain chain mode a seeded request's draws come from its generator), and their
        distributions over the target's ``vocab_size`` tokens, [B, k, V], appended to ``probs``: whatever it
        draws from, the rejection sampler is handed that distribution.  ``conf``: a list to append the drafter's
        probability of each drafted token to, [B, k] (the drawn token's under its temperature)."""
        k = self.k
        if probs is None:
            if conf is not None:
                p, ids = logits.float().softmax(-1).max(-1)
                conf.append(p.view(B, k))
                return head.to_target_ids(ids).view(B, k)
            return head.to_target_ids(logits.argmax(-1)).view(B, k)
        sm, s = sampling, self.draft_temperature_scale
        if s != 1.0 and sm.temperature is not None:  # sampled rows at s x their temperature (greedy rows stay)
            t = sm.temperature
            sm = dataclasses.replace(sm, temperature=torch.where(t < SAMPLING_EPS, t, (t * s).clamp_min(1e-3)))
        ids, p = self.sample_logits(logits, sm)          # per-request temperature, k rows each
        # plain chain mode: a seeded request draws its drafts from its own generator, so its output repeats whatever
        # else the engine runs.  With prompt lookup or draft_confidence its drafts are dropped (the runner hook's
        # without_seeded): its generator is left to vLLM's sampler alone
        plain_chain = self.lookup is None and not self.draft_confidence
        for i, gen in (sampling.generators.items() if plain_chain else ()):
            if i < B:
                r = slice(i * k, (i + 1) * k)
                ids[r] = (p[r] / torch.empty_like(p[r]).exponential_(generator=gen)).argmax(-1)
        if conf is not None:
            conf.append(p.gather(1, ids.view(-1, 1)).view(B, k).float())
        if head.truncated:  # the draft vocabulary's probabilities at their target ids, zero elsewhere
            if getattr(self, "_draft_vocab_ids", None) is None:
                self._draft_vocab_ids = head.to_target_ids(torch.arange(p.shape[-1], device=p.device))
            full = p.new_zeros(B * k, vocab_size)
            p = full.index_copy_(1, self._draft_vocab_ids, p)
        probs.append(p.view(B, k, -1))
        return head.to_target_ids(ids).view(B, k)

    def draft_tree(self, rows: torch.Tensor, positions: torch.Tensor, K: int, block_table: torch.Tensor,
                   max_prefix: int) -> torch.Tensor:
        """The SAR tree passes after the relaxed block -> the node tokens [B, K]
        (:func:`falcon_vllm.core.tree_draft.draft_tree`)."""
        return tree_draft.draft_tree(self, rows, positions, K, block_table, max_prefix)
