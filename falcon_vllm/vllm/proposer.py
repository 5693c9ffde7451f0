"""FalconProposer: semi-autoregressive chain drafting on vLLM's paged KV cache.

vLLM's V1 runner instantiates ``EagleProposer`` for ``method == "eagle"``; the plugin replaces that
name with this subclass, which delegates to stock EAGLE unless the draft config carries a
``falcon`` section.  For a Falcon drafter (block size k) one step drafts K tokens in
``ceil(K / k)`` drafter passes.  Drafter position j reads ``(x_{j+1}, f_j)``; p is a request's
last committed position (its pending token ``x_{p+1}`` was just sampled by the target).

* chunk pass (stock EAGLE first pass, causal): every token the target just verified is fed to
  the drafter; this writes the drafter's KV cache for those positions.  Its outputs are unused.
* pass 1, the relaxed block: positions ``p-k+1 .. p`` run again as one non-causal block (the
  end-aligned relaxed mask the drafter is trained with), attending to the paged prefix.  Block row
  r predicts draft token r+1 (``x_{p+2+r}``).  Rows older than this step's chunk (when
  ``accepted + 1 < k``) take their inputs from a per-request stash of the previous step's last
  k-1 rows (:mod:`falcon_vllm.vllm.stash`).  Rows whose inputs are unknown (a context shorter
  than k, a prefix-cache hit, an evicted stash entry) still run as queries but write no KV (slot
  -1), so the genuine KV at their positions stays; only their own draft tokens are worse.
* On CPU the chunk pass and pass 1 run as one drafter pass (:meth:`FalconProposer._fused_pass`: vLLM's
  per-request causal flags tell the causal chunks from the non-causal blocks), so a step reads the
  drafter's weights once, and it runs only the chunk rows before each relaxed block (the others would
  write no K/V and their outputs are unused); elsewhere (FlashAttention takes per-request causal flags
  only from FA4) they run as two passes.  All give the same drafts.
* prompt lookup (``prompt_lookup_max``, :mod:`falcon_vllm.vllm.lookup`): a request whose tokens end in a
  repeated n-gram gets vLLM's n-gram draft instead (or, with a ``datastore``, one retrieved from the target's
  stored answers); the drafter's chain covers the others, and when every request of a step has a lookup
  draft no drafter pass runs: its verified rows wait (``defer_chunk``) and the next pass runs them first.  So do a
  step's rows when vLLM's dynamic speculation turns drafting off at its batch size (``keep_gap_rows``): a request
  drafts again with its drafter K/V whole once the batch shrinks.
* ``draft_confidence``: each chain draft stops before its first token where the product of the drafter's
  probabilities of its tokens (a sampled draft's: of the drawn tokens) falls below the threshold
  (:meth:`FalconProposer.cut`, applied by the runner hook), and a further pass runs only while some request's draft
  is still going.
* passes 2..: one k-token block per request at positions ``p+1+k(q-1) ..``, whose input tokens
  are the previous block's k drafted tokens and whose input features are the previous block's k
  outputs, attending to the paged prefix, the earlier blocks and (non-causally) itself.

For a 1-layer drafter this is exactly the reference engine's computation (the KV of layer 0 does
not depend on the mask); with more layers the positions before the relaxed block keep their
causal KV (the reference uses relaxed blocks there too), which changes acceptance, never output: for the shipped
2-layer drafter, top-1 within 0.004 of training's relaxed context (``heldout_eval.py --context causal``).

Drafts are the drafter's argmax on each row, verified by vLLM's own rejection sampler as one-hot
proposals; with ``draft_sample_method`` "probabilistic" a sampled request's chain drafts are drawn
from the drafter's distribution at ``draft_temperature_scale`` x its temperature (from its own
generator when seeded), and that distribution goes to the rejection sampler.  Either way the output
is exactly vanilla vLLM's (greedy) or distributed exactly as the target (sampling) whatever the
drafter does; tree nodes are always the drafter's top candidates.  ``steps`` / ``passes``
count proposals and drafter passes (relaxed block + block passes) so tests can check
``ceil(K / k)`` per step.  No pass runs in a CUDA graph; on CPU under vLLM's torch.compile mode
(no ``enforce_eager``) the drafter's forward is compiled like the target's (``FalconDraftModel``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.sample.sampler import _SAMPLING_EPS  # a temperature below it is greedy (vLLM's sampler)
from vllm.v1.spec_decode.eagle import EagleProposer

from falcon_vllm.datastore import Datastore
from falcon_vllm.tree import DecodingTree
from falcon_vllm.vllm import lookup, patches, prefix_gaps, tree_verify
from falcon_vllm.vllm.lookup import LookupState
from falcon_vllm.vllm.model import wrap_gemms
from falcon_vllm.vllm.options import check_async_scheduling, check_cudagraph_mode
from falcon_vllm.vllm.paged_kv import tree_attention_scope
from falcon_vllm.vllm.stash import BlockInputStash
from falcon_vllm.vllm.tree_draft import DraftTreeAttention, TreeState

logger = init_logger(__name__)
PADDING_SLOT_ID = -1  # the KV-cache writers skip negative slots


def falcon_section(draft_model_config) -> dict | None:
    if draft_model_config is None:
        return None
    f = getattr(draft_model_config.hf_config, "falcon", None)
    return dict(f) if isinstance(f, dict) else None


def unwrap_model(model):
    while hasattr(model, "unwrap"):
        model = model.unwrap()
    return model


def falcon_proposer(runner) -> "FalconProposer | None":
    """The runner's drafter when it is a Falcon proposer running a Falcon drafter (else None: vLLM's own)."""
    drafter = getattr(runner, "drafter", None)
    return drafter if isinstance(drafter, FalconProposer) and drafter.falcon else None


class FalconProposer(EagleProposer):
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.falcon = falcon_section(self.speculative_config.draft_model_config)
        self.k = int(self.falcon["k"]) if self.falcon else 1
        # block_order "reversed": a block's last row outputs level 1 (FalconDrafter.forward's level_order)
        self.reversed_blocks = bool(self.falcon) and self.falcon.get("block_order", "forward") == "reversed"
        # level embedding: each pass tells the drafter its rows' offsets inside their k-blocks (_set_offsets)
        self.level_embedding = bool(self.falcon) and bool(self.falcon.get("level_embedding"))
        self.steps = 0   # propose() calls that drafted tokens
        self.passes = 0  # drafter passes that produced draft tokens (relaxed block + block passes)
        self.skipped_steps = 0  # steps with no drafts scheduled (the runner's fast path skipped drafting)
        self.gap_steps = 0  # steps whose every request has a drafter-KV gap: lookup drafts only, no drafter pass
        self.lookup_only_steps = 0  # steps past falcon_max_batch: lookup drafts only, the rows kept, no drafter pass
        self.tree: DecodingTree | None = None  # tree mode (None: chain mode)
        self.tree_state: TreeState | None = None  # tree mode's state (tree_draft.TreeState)
        self.lookup: LookupState | None = None  # prompt lookup first (chain mode; falcon_vllm.vllm.lookup)
        # sampled drafts (draft_sample_method "probabilistic"): the drafter's temperature over the request's
        self.draft_temperature_scale = float((self.falcon or {}).get("draft_temperature_scale", 1.0))
        # draft_confidence: a chain draft stops where the drafter's probability of it so far falls below this
        self.draft_confidence = float((self.falcon or {}).get("draft_confidence", 0.0))
        self.proposed = False  # the runner asked for this step's drafts (set by the runner hook)
        self.draft_lengths: list[int] | None = None  # this step's chain lengths under draft_confidence
        self.last_confidence: torch.Tensor | None = None  # [B, K]: the drafter's probability of each chain token
        if not self.falcon:
            return
        # the config hook turns async scheduling off for ragged drafts; a config built another way is refused here
        check_async_scheduling(self.falcon, vllm_config.scheduler_config.async_scheduling)
        if self.falcon.get("prompt_lookup"):
            lo, hi = self.falcon["prompt_lookup"]
            store = self.falcon.get("datastore")
            self.lookup = LookupState(lo, hi, self.falcon["falcon_tokens"], self.falcon.get("lookup_tokens"),
                                      Datastore.load(store).build() if store else None,
                                      self.falcon.get("datastore_tokens"), self.falcon.get("datastore_max_batch"),
                                      self.falcon.get("falcon_max_batch"))
            lookup.warm_up()
        if self.falcon.get("mode") == "tree":
            self.tree = DecodingTree(self.falcon["tree"], self.k, self.falcon.get("tree_name"))
            # the config hook chose PIECEWISE where unset; this catches a VllmConfig built without EngineArgs
            check_cudagraph_mode(self.falcon, vllm_config.compilation_config.cudagraph_mode)
            self.tree_state = TreeState(self.tree, self.falcon.get("subtrees"))
        if self.uses_mrope:
            raise NotImplementedError("falcon-vllm: targets with M-RoPE positions are not supported")
        self._runner = runner  # its input batch gives the request ids (for the stash)
        # chunk pass + relaxed block in one drafter pass: needs per-request causal flags, which vLLM's CPU
        # attention implements (its FlashAttention only from FA4): elsewhere the two passes run separately
        self.fuse_chunk = current_platform.is_cpu()
        self.prune_chunk = True  # the fused pass runs only the chunk rows before each block (False: all, for A/Bs)
        # a step whose drafts all come from prompt lookup runs no drafter pass: its verified rows wait (at most
        # defer_rows per request) for the next pass, which runs them first (False: every step runs one, for A/Bs)
        self.defer_chunk = True
        self.defer_rows = 32
        self.deferred_steps = 0  # steps whose drafter pass was deferred
        # a step with drafting off (lookup mode) keeps its verified rows, at most gap_rows per request, for the next
        # drafter pass, so that a request's drafter K/V has no gap when drafting resumes (keep_gap_rows; 0: off).  Not
        # more: catching up a whole prompt prefilled with drafting off cost more than it bought (ab_gap_rows_b4_*_spr.md)
        self.gap_rows = 64
        self._pending_blocks: dict[int, set[int]] = {}  # stash slot -> the blocks of its pending rows
        self._stash = BlockInputStash(2 * self.max_batch_size, self.k, self.hidden_size, device, self.dtype,
                                      ids_dtype=self.input_ids.dtype)
        if self.tree is not None:
            logger.info("falcon-vllm: Falcon proposer active in tree mode: %r (%d drafter passes per step)",
                        self.tree, self.tree.num_passes)
        else:
            logger.info("falcon-vllm: Falcon proposer active (k=%d, K=%d -> %d drafter passes per step)",
                        self.k, self.num_speculative_tokens, math.ceil(self.num_speculative_tokens / self.k))

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        wrap_gemms(unwrap_model(self.model))  # a drafter whose matmuls run in bf16 (model.gemm_dtype)
        if self.falcon:
            unwrap_model(self.model).attach_falcon_proposer()

    def initialize_attn_backend(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_attn_backend(kv_cache_config, *args, **kwargs)
        if self.falcon:  # start-up: the KV cache and every attention backend exist, no request yet
            patches.check_instances(self._runner, self.vllm_config, tree=self.tree is not None)
        if self.tree is not None:
            tree_verify.check_startup(self.vllm_config, kv_cache_config, self._draft_attn_layer_names)

    # ------------------------------------------------------------------ propose
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        if not self.falcon:
            return super().propose(num_speculative_tokens, target_token_ids, target_positions,
                                   target_hidden_states, next_token_ids, token_indices_to_sample,
                                   common_attn_metadata, sampling_metadata, mm_embed_inputs,
                                   num_rejected_tokens_gpu, slot_mappings)
        K, k = num_speculative_tokens, self.k
        self.num_speculative_tokens = K
        if self.lookup is not None:  # the drafter's chain where prompt lookup finds nothing
            K = min(K, self.lookup.falcon_tokens)
        self._last_draft_probs = None  # greedy drafts: one-hot proposals for the rejection sampler
        self.draft_lengths = None
        B = common_attn_metadata.batch_size()
        if K == 0:
            # vLLM's dynamic speculation turned drafting off at this batch size (e.g. a tune-tree fit):
            # skip the drafter entirely.  Positions verified meanwhile have no drafter K/V, which only
            # lowers acceptance for a while if drafting resumes at a smaller batch.
            return torch.empty(B, 0, dtype=torch.int64, device=self.device)

        # the step's chunk: every token the target just verified, as vLLM's EAGLE lays it out
        num_tokens, last, cad = self.set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids,
            target_positions=target_positions, target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample, cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu)
        ids, feats, positions, known = self._relaxed_block_inputs(cad, last.long(), B)
        drafting = self.lookup is None or not self.lookup.all_matched  # else every request has a lookup draft
        # rows deferred or kept by earlier steps, which the fused pass runs before this step's chunk
        pending = self._stash.total_rows(self._step_slots.tolist()) if self._stash.pending else 0
        fused = self.fuse_chunk and num_tokens + B * k + pending <= self.input_ids.shape[0]
        if pending and not fused:  # only a fused pass runs pending rows: whose rows are dropped have a gap
            self._drop_pending(B)
        if fused and not drafting and self.defer_chunk and self._defer(cad, last.long(), B):
            self.deferred_steps += 1  # prompt lookup serves every request: the next drafter pass writes these rows
            return torch.empty(B, 0, dtype=torch.int64, device=self.device)
        if fused:
            # chunk pass and pass 1 (the relaxed block -> draft tokens 1..k) in one drafter pass
            rows = self._fused_pass(cad, num_tokens, last.long(), ids, feats, positions, known)
            self.passes += drafting
        else:
            # chunk pass: stock causal EAGLE pass over every verified token (writes the drafter KV)
            self._set_offsets(self._chunk_offsets(cad, num_tokens, positions))
            self._forward(self.build_per_group_and_layer_attn_metadata(cad)[1], num_tokens, cad.slot_mapping)
            rows = None
        if not drafting:
            return torch.empty(B, 0, dtype=torch.int64, device=self.device)
        self.steps += 1
        if rows is None:  # pass 1: the relaxed block -> draft tokens 1..k
            rows = self._block_pass(cad, ids, feats, positions, writes=known, extra_len=0)  # [B, k, H]
        if self.tree is not None:
            return self._draft_tree(cad, rows, positions, K)
        # draft_sample_method "probabilistic": tokens sampled from the drafter at each request's temperature, their
        # distributions handed to vLLM's rejection sampler (take_last_draft_probs); else the drafter's argmax
        probs = [] if self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy else None
        conf = [] if self.draft_confidence else None  # the drafter's probability of each drafted token
        drafted = [self._draft(rows, sampling_metadata, probs, conf)]
        # passes 2..: one k-token block per request on top of the previous one
        next_pos = positions[:, -1:] + 1 + torch.arange(k, device=positions.device)[None]  # [B, k]
        for q in range(1, math.ceil(K / k)):
            if conf is not None and not bool((torch.cat(conf, 1).prod(1) >= self.draft_confidence).any()):
                break  # every request's draft already stops: no further pass
            rows = self._block_pass(cad, drafted[-1], rows, next_pos + k * (q - 1), writes=None, extra_len=q * k)
            drafted.append(self._draft(rows, sampling_metadata, probs, conf))
        if self.steps == 1:
            logger.info("falcon-vllm: drafted K=%d tokens in %d drafter passes (k=%d)", K, math.ceil(K / k), k)
        if probs is not None:
            self._last_draft_probs = torch.cat(probs, dim=1)[:, :K].contiguous()
        if conf is not None:
            self.last_confidence = torch.cat(conf, 1)[:, :K]
            self.draft_lengths = (self.last_confidence.cumprod(1) >= self.draft_confidence).sum(1).tolist()
        return torch.cat(drafted, dim=1)[:, :K].to(torch.int64)

    def cut(self, chain: torch.Tensor) -> list[list[int]]:
        """This step's chain drafts [B, <=K] as per-request lists, each cut to its ``draft_confidence`` length."""
        rows = chain.tolist()
        if self.draft_lengths is not None:
            rows = [r[:n] for r, n in zip(rows, self.draft_lengths)]
            self.draft_lengths = None
        return rows

    # ------------------------------------------------------------------ tree mode
    def _draft_tree(self, cad, rows: torch.Tensor, positions: torch.Tensor, K: int) -> torch.Tensor:
        """The SAR tree passes after the relaxed block; returns the node tokens [B, K].

        ``K`` may be below the tree size (vLLM's dynamic speculation); the first K nodes (in slot
        order, parents first) form a valid tree and only the passes it needs are run.
        """
        tree = self.tree_state.subtrees.get(K)
        self.tree_state.drafted_k = K
        B, k, H = rows.shape
        prefix = positions[:, -1].long() + 1         # drafter positions 0..n-1 are in the paged cache
        attn = DraftTreeAttention(cad.block_table_tensor[:B], prefix, k, max_prefix=cad.max_seq_len)
        offs = torch.arange(k, device=rows.device)

        def run_pass(p, ids, feats, ancestors):
            nb = ids.shape[1]
            pos = (prefix[:, None, None] + k * (p - 1) + offs).expand(B, nb, k)
            attn.begin_pass(ancestors)
            out = self._tree_block_pass(attn, ids.reshape(B * nb, k), feats.reshape(B * nb, k, H),
                                        pos.reshape(B * nb, k))
            return out.view(B, nb * k, H)

        nodes = tree.draft(rows, lambda r: self._topk(r, tree.topk), run_pass)
        if self.steps == 1:
            logger.info("falcon-vllm: drafted a %d-node tree in %d drafter passes (k=%d)", tree.num_nodes,
                        tree.num_passes, k)
        return nodes

    def _tree_block_pass(self, attn, ids, feats, positions) -> torch.Tensor:
        """One drafter pass over tree blocks [NB, k]; attention by ``attn`` (no paged-cache writes)."""
        NB, k = ids.shape
        n = NB * k
        flat_pos = positions.clamp(0, self.max_model_len - 1).reshape(-1)
        self._set_rows(0, ids, feats, flat_pos)
        self._set_offsets(self._block_offsets(NB, ids.device))
        per_layer = {name: None for name in self._draft_attn_layer_names}
        with tree_attention_scope(attn), set_forward_context(per_layer, self.vllm_config, num_tokens=n,
                                                             cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                                             slot_mapping={}):
            out, _ = self.model(input_ids=self.input_ids[:n], positions=self.positions[:n],
                                hidden_states=self.hidden_states[:n])
        self.passes += 1
        out = out[:n].view(NB, k, -1)
        return out.flip(1) if self.reversed_blocks else out

    def _topk(self, rows: torch.Tensor, topk: int) -> torch.Tensor:
        """rows [B, R, H] -> the drafter's top candidates [B, R, topk] (rank order)."""
        B, R, H = rows.shape
        ids = self.model.compute_logits(rows.reshape(B * R, H)).topk(topk, dim=-1).indices
        return unwrap_model(self.model).to_target_ids(ids).view(B, R, topk)

    # ------------------------------------------------------------------ pieces
    def _relaxed_block_inputs(self, cad, last: torch.Tensor, B: int):
        """Inputs of the relaxed block, the last k committed positions of each request.

        last [B] = flat index of each request's last valid row in the chunk buffers.  Returns
        ids [B, k], feats [B, k, H], positions [B, k] (< 0 before the sequence start) and
        known [B, k] bool (inputs known: from this chunk or the stash; a suffix of each row).
        """
        k = self.k
        offs = torch.arange(k - 1, -1, -1, device=last.device)              # k-1 .. 0
        idx = last[:, None] - offs[None]                                      # [B, k]
        known = idx >= cad.query_start_loc[:B].long()[:, None]
        safe = torch.where(known, idx, last[:, None].expand_as(idx))
        ids = self.input_ids[safe]                                            # gathers copy
        feats = self.hidden_states[safe]
        positions = self.positions[last].long()[:, None] - offs[None]
        slots = self._step_slots = self._stash.slots(self._req_ids(B), last.device)
        if self._stash.pending:
            self._stash.retain(slots.tolist())
        if k > 1:
            known = self._stash.fill(slots, ids, feats, positions, known)
            self._stash.update(slots, ids, feats, positions, known)
        return ids, feats, positions, known

    def _block_pass(self, cad, ids, feats, positions, writes, extra_len: int):
        """Run one non-causal k-token block per request; returns the output features [B, k, H].

        ids [B, k]; feats [B, k, H]; positions [B, k] consecutive; writes [B, k] bool or None
        (rows whose KV is written; None = all); extra_len = how far the block's end lies past
        the relaxed block's end (bounds the context length without a device sync).
        """
        B, k = ids.shape
        n = B * k
        qsl_cpu = torch.arange(0, n + 1, k, dtype=torch.int32)
        seq_lens = (positions[:, -1] + 1).clamp(1, self.max_model_len).to(torch.int32)
        slot_mapping = self._slots(cad.block_table_tensor, positions)
        if writes is not None:
            slot_mapping = torch.where(writes.reshape(-1), slot_mapping, PADDING_SLOT_ID)
        flat_pos = positions.clamp(0, self.max_model_len - 1).reshape(-1)
        upper = cad.seq_lens_cpu_upper_bound
        blk_cad = cad.replace(
            query_start_loc=qsl_cpu.to(ids.device, non_blocking=True), query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens, num_actual_tokens=n, max_query_len=k,
            max_seq_len=min(cad.max_seq_len + extra_len, self.max_model_len),
            slot_mapping=slot_mapping, causal=False,
            seq_lens_cpu_upper_bound=None if upper is None else (upper + extra_len).clamp(max=self.max_model_len),
            positions=None if cad.positions is None else flat_pos,
            _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)
        _, per_layer = self.build_per_group_and_layer_attn_metadata(blk_cad, draft_index=1)
        self._set_rows(0, ids, feats, flat_pos)
        self._set_offsets(self._block_offsets(B, ids.device))
        out = self._forward(per_layer, n, slot_mapping)
        self.passes += 1
        out = out[:n].view(B, k, -1)
        return out.flip(1) if self.reversed_blocks else out

    def _fused_pass(self, cad, num_tokens: int, last: torch.Tensor, ids, feats, positions, known) -> torch.Tensor:
        """The chunk pass and the relaxed block in one drafter pass; returns the blocks' outputs [B, k, H].

        Two query groups per request in one attention call, told apart by vLLM's per-request causal flags
        (``CommonAttentionMetadata.causal`` as a tensor; the CPU attention backend implements them): the chunk
        rows before each request's relaxed block (causal; they write the drafter KV of those verified tokens),
        then the B relaxed blocks (non-causal, k rows each), which write the KV of the block positions.  Only
        the chunk rows before the block run: the chunk rows inside it (the block writes their positions, with
        the same inputs) and the rejected rows after it (vLLM's padded drafter batch) would write nothing and
        their outputs are unused, so at batch 1 with K=2 a step runs 2-3 drafter rows instead of 5.  A request
        with no such row has no chunk group.  Within a layer every row's K/V is written before any row attends,
        so a block sees its chunk's rows as separate passes would.  The drafter's weights are read once per step
        instead of twice; the outputs equal the two passes'.
        """
        B, k = ids.shape
        dev = ids.device
        row = torch.arange(num_tokens, device=dev)
        req = self._row_requests(cad, row, B)
        before_block = row <= last[req] - k
        table = cad.block_table_tensor[:B]
        if self.prune_chunk:
            keep = torch.nonzero(before_block).squeeze(1)       # chunk rows before their request's block
            chunk_slots = cad.slot_mapping[keep].long()
        else:  # every chunk row (for A/B measurements): those from the block on write no K/V
            keep = row
            chunk_slots = torch.where(before_block, cad.slot_mapping[:num_tokens].long(), PADDING_SLOT_ID)
        chunk_req, chunk_ids, chunk_pos = req[keep], self.input_ids[keep], self.positions[keep]
        chunk_feats = self.hidden_states[keep]
        if self.level_embedding:  # chunk rows: blocks aligned to each request's end, as the reference lays them out
            offsets = self._end_offsets(chunk_pos, positions[chunk_req, -1])
        pend = None
        if self._stash.pending:  # rows deferred by steps served by prompt lookup alone run first
            starts = self.positions[cad.query_start_loc[:B].long()].tolist()
            pend = self._stash.take(self._step_slots.tolist(), starts, positions[:, 0].tolist())
            for s in set(self._step_slots.tolist()) - self._stash.dropped:  # run now: written
                self._pending_blocks.pop(s, None)
        if pend is not None:
            p_req, p_ids, p_feats, p_offs, p_pos = (t.to(dev) for t in pend)
            order = torch.argsort(torch.cat([p_req, chunk_req]), stable=True)  # each request's rows in position order
            chunk_req = torch.cat([p_req, chunk_req])[order]
            chunk_ids = torch.cat([p_ids.to(chunk_ids.dtype), chunk_ids])[order]
            chunk_pos = torch.cat([p_pos.to(chunk_pos.dtype), chunk_pos])[order]
            chunk_feats = torch.cat([p_feats.to(chunk_feats.dtype), chunk_feats])[order]
            chunk_slots = torch.cat([self._slots(table[p_req], p_pos[:, None]), chunk_slots])[order]
            if self.level_embedding:
                offsets = torch.cat([p_offs, offsets])[order]
        rows_per_req = torch.bincount(chunk_req, minlength=B).cpu()
        nc, n = chunk_req.numel(), chunk_req.numel() + B * k
        chunked = torch.nonzero(rows_per_req).squeeze(1)        # requests with a chunk group
        if nc and (self.prune_chunk or pend is not None):
            self.input_ids[:nc] = chunk_ids
            self.positions[:nc] = chunk_pos
            self.hidden_states[:nc] = chunk_feats
        block_slots = torch.where(known.reshape(-1), self._slots(cad.block_table_tensor, positions), PADDING_SLOT_ID)
        slot_mapping = torch.cat([chunk_slots, block_slots])
        counts = torch.cat([rows_per_req[chunked], torch.full((B,), k, dtype=torch.long)])
        qsl_cpu = torch.zeros(len(counts) + 1, dtype=torch.int32)
        torch.cumsum(counts, 0, out=qsl_cpu[1:])
        chunk_idx = chunked.to(dev)
        block_lens = (positions[:, -1] + 1).clamp(1, self.max_model_len)
        chunk_lens = positions[chunk_idx, 0] if self.prune_chunk else cad.seq_lens[chunk_idx]  # a chunk ends before its block
        seq_lens = torch.cat([chunk_lens.to(cad.seq_lens.dtype), block_lens.to(cad.seq_lens.dtype)])
        causal = torch.cat([torch.ones(len(chunked), dtype=torch.int32), torch.zeros(B, dtype=torch.int32)]).to(dev)
        flat_pos = positions.clamp(0, self.max_model_len - 1).reshape(-1)
        upper = cad.seq_lens_cpu_upper_bound
        fused = cad.replace(
            query_start_loc=qsl_cpu.to(dev, non_blocking=True), query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens,
            num_reqs=len(counts), num_actual_tokens=n, max_query_len=int(counts.max()),
            block_table_tensor=torch.cat([table[chunk_idx], table]), slot_mapping=slot_mapping, causal=causal,
            seq_lens_cpu_upper_bound=None if upper is None else torch.cat([upper[chunked], upper[:B]]),
            positions=None if cad.positions is None else torch.cat([chunk_pos.to(flat_pos.dtype), flat_pos]),
            _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)
        _, per_layer = self.build_per_group_and_layer_attn_metadata(fused)
        if self.level_embedding:
            self._set_offsets(torch.cat([offsets, self._block_offsets(B, dev)]))
        self._set_rows(nc, ids, feats, flat_pos)
        out = self._forward(per_layer, n, slot_mapping)[nc:n].view(B, k, -1)
        return out.flip(1) if self.reversed_blocks else out

    def _defer(self, cad, last: torch.Tensor, B: int) -> bool:
        """Keep each request's verified rows (the drafter's inputs of this step's chunk) as pending rows for the next
        drafter pass instead of running one now; False (nothing kept) when one would exceed ``defer_rows``."""
        start, end = cad.query_start_loc_cpu[:B].tolist(), last.tolist()
        # a row's level offset: from its request's end now, as this step's pass would give it
        rows = [(self.input_ids[a:e + 1].clone(), self.hidden_states[a:e + 1].clone(),
                 self._end_offsets(self.positions[a:e + 1], int(self.positions[e])), int(self.positions[a]))
                for a, e in zip(start, end)]
        if not self._stash.defer(self._step_slots.tolist(), rows, self.defer_rows):
            return False
        for s, r, row in zip(self._step_slots.tolist(), self._req_ids(B), rows):
            self._remember_blocks(s, r, row[3], len(row[0]))
        return True

    def keep_gap_rows(self, runner, hidden_states, sampled_token_ids) -> set[str]:
        """A step with drafting off (lookup mode, on CPU): keep each request's verified rows, the drafter inputs
        (token ``x_{q+1}``, target feature ``f_q``) of every position q it verified, as pending rows that the next
        drafter pass runs first, so that its drafter K/V has no gap when the batch shrinks and drafting resumes.
        Returns the ids of the requests whose rows were kept; the others (past ``gap_rows`` rows, not decoding
        from the sampler's tensor, or already gapped) have a gap (``LookupState.gapped``)."""
        batch = runner.input_batch
        B = batch.num_reqs
        if not (self.fuse_chunk and self.gap_rows) or not torch.is_tensor(sampled_token_ids) or hidden_states is None:
            return set()
        req_ids = list(batch.req_ids[:B])
        qsl = runner.query_start_loc.cpu[:B + 1].tolist()
        sampled = sampled_token_ids.cpu().numpy()[:B]
        discard = runner.discard_request_mask.np[:B]  # partial prefills: the next token is the prompt's
        slots = self._stash.slots(req_ids, hidden_states.device).tolist()
        self._stash.retain(slots)
        kept = set()
        for i, (r, s) in enumerate(zip(req_ids, slots)):
            if r in self.lookup.gapped:
                continue
            first, n_tok = int(batch.num_computed_tokens_cpu[i]), int(batch.num_tokens_no_spec[i])
            new = np.empty(0, dtype=np.int64) if discard[i] else sampled[i][sampled[i] >= 0]
            # the tokens after positions first..: the committed ones, then this step's sampled ones
            after = np.concatenate([batch.token_ids_cpu[i, first + 1:n_tok], new])
            n = min(len(after), qsl[i + 1] - qsl[i])  # verified rows: a chunk's, or the accepted drafts and one more
            if n <= 0:
                continue
            pos = torch.arange(first, first + n)
            piece = (torch.from_numpy(after[:n].astype(np.int64)), hidden_states[qsl[i]:qsl[i] + n].clone(),
                     self._end_offsets(pos, first + n - 1), first)
            if self._stash.keep(s, piece, self.gap_rows):
                kept.add(r)
                self._remember_blocks(s, r, first, n)
        return kept

    def take_proposed(self) -> bool:
        """Whether the runner asked for drafts since the last call (it skips the drafter near max_model_len)."""
        proposed, self.proposed = self.proposed, False
        return proposed

    def note_drops(self) -> None:
        """Mark the requests whose pending rows the stash dropped unrun (``BlockInputStash.dropped``): their drafter
        K/V has a gap, so they get no drafter chain (``LookupState.gapped``), and the blocks of those rows are kept out
        of the prefix cache (:mod:`falcon_vllm.vllm.prefix_gaps`).  Then every gapped request's blocks from its gap
        on are marked too (its rows of steps without a drafter pass are lost)."""
        for s in self._stash.dropped:
            prefix_gaps.mark(self._pending_blocks.pop(s, ()))
        dropped = self._stash.drain_dropped()
        if self.lookup is None:
            return
        requests = self._runner.requests
        if dropped:
            self.lookup.gap([r for r in dropped if r in requests], requests)
        for r, start in self.lookup.gap_from.items():
            prefix_gaps.mark(prefix_gaps.blocks_of(self._runner, r, start))

    def _remember_blocks(self, slot: int, req_id: str | None, first: int, n: int) -> None:
        """The blocks of a pending piece's rows (``first .. first+n``): marked if the piece is dropped unrun."""
        if req_id is not None:
            self._pending_blocks.setdefault(slot, set()).update(
                prefix_gaps.blocks_of(self._runner, req_id, first, first + n))

    def _drop_pending(self, B: int) -> None:
        """Drop the step's requests' pending rows (they do not fit one fused pass): their drafter K/V has a gap."""
        for s in self._step_slots.tolist():
            self._stash._drop(s)  # note_drops marks the owners gapped and their blocks

    def _block_offsets(self, nb: int, device) -> torch.Tensor | None:
        """Row offsets of ``nb`` k-row blocks laid out one after another (None: no level embedding)."""
        return torch.arange(self.k, device=device).repeat(nb) if self.level_embedding else None

    def _chunk_offsets(self, cad, num_tokens: int, positions: torch.Tensor):
        """Offsets of the step's chunk rows: blocks aligned to each request's end (its last committed position
        ``positions[:, -1]``), as the reference engine's chunk pass lays them out (None: no level embedding)."""
        if not self.level_embedding:
            return None
        req = self._row_requests(cad, torch.arange(num_tokens, device=positions.device), positions.shape[0])
        return self._end_offsets(self.positions[:num_tokens], positions[req, -1])

    def _end_offsets(self, pos: torch.Tensor, end) -> torch.Tensor:
        """Level offsets of rows at positions ``pos`` in k-blocks aligned to their request's last committed position
        ``end`` (a tensor per row, or an int)."""
        return (pos.long() - end - 1) % self.k

    @staticmethod
    def _row_requests(cad, row: torch.Tensor, B: int) -> torch.Tensor:
        """The request (0..B-1) of each flat chunk row index in ``row``."""
        return torch.searchsorted(cad.query_start_loc[1:B + 1].long(), row, right=True).clamp(max=B - 1)

    def _set_offsets(self, offsets: torch.Tensor | None) -> None:
        if offsets is not None:
            unwrap_model(self.model).model.set_level_offsets(offsets)

    def _set_rows(self, start: int, ids, feats, flat_pos) -> None:
        """Write block rows (ids [B, k], feats [B, k, H], flat positions) into the drafter's input buffers at ``start``."""
        n = ids.numel()
        self.input_ids[start:start + n] = ids.reshape(-1).to(self.input_ids.dtype)
        self.positions[start:start + n] = flat_pos.to(self.positions.dtype)
        self.hidden_states[start:start + n] = feats.reshape(n, -1)

    def _forward(self, per_layer, n: int, slot_mapping) -> torch.Tensor:
        """The drafter over its input buffers' first ``n`` rows (no CUDA graph), writing K/V at ``slot_mapping``."""
        with set_forward_context(per_layer, self.vllm_config, num_tokens=n, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 slot_mapping=self._get_slot_mapping(n, slot_mapping)):
            out, _ = self.model(input_ids=self.input_ids[:n], positions=self._get_positions(n),
                                hidden_states=self.hidden_states[:n])
        return out

    def _slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """positions [B, T] -> flat KV slots [B*T] (PADDING for positions outside [0, max_model_len))."""
        bs = self.block_size
        pos = positions.clamp(0, self.max_model_len - 1).long()
        blk = block_table.long().gather(1, (pos // bs).clamp(max=block_table.shape[1] - 1))
        slots = blk * bs + pos % bs
        outside = (positions < 0) | (positions >= self.max_model_len)
        return torch.where(outside, PADDING_SLOT_ID, slots).reshape(-1)

    def _draft(self, rows: torch.Tensor, sampling_metadata=None, probs: list | None = None,
               conf: list | None = None) -> torch.Tensor:
        """rows [B, k, H] -> draft tokens [B, k] (target ids).  ``probs`` None: the drafter's argmax.  Else tokens
        sampled from the drafter at each request's temperature (vLLM's draft sampling: greedy requests keep the
        argmax; a seeded request's draws come from its generator; ``draft_temperature_scale`` scales the sampled
        rows' temperatures), and their distributions over the target's vocabulary, [B, k, V], appended to
        ``probs``: whatever it draws from, the rejection sampler is handed that distribution.  ``conf``: a list to
        append the drafter's probability of each drafted token to, [B, k] (the drawn token's under its temperature)."""
        B, k, H = rows.shape
        head = unwrap_model(self.model)
        logits = self.model.compute_logits(rows.reshape(B * k, H))
        if probs is None:
            if conf is not None:
                p, ids = logits.float().softmax(-1).max(-1)
                conf.append(p.view(B, k))
                return head.to_target_ids(ids).view(B, k)
            return head.to_target_ids(logits.argmax(-1)).view(B, k)
        sm, s = sampling_metadata, self.draft_temperature_scale
        if s != 1.0 and sm.temperature is not None:  # sampled rows at s x their temperature (greedy rows stay)
            t = sm.temperature
            sm = dataclasses.replace(sm, temperature=torch.where(t < _SAMPLING_EPS, t, (t * s).clamp_min(1e-3)))
        ids, p = self._sample_from_logits(logits, sm)          # per-request temperature, k rows each
        # plain chain mode: a seeded request draws its drafts from its own generator, so its output repeats whatever
        # else the engine runs.  With prompt lookup or draft_confidence its drafts are dropped (the runner hook's
        # without_seeded): its generator is left to vLLM's sampler alone
        plain_chain = self.lookup is None and not self.draft_confidence
        for i, gen in (sampling_metadata.generators.items() if plain_chain else ()):
            if i < B:
                r = slice(i * k, (i + 1) * k)
                ids[r] = (p[r] / torch.empty_like(p[r]).exponential_(generator=gen)).argmax(-1)
        if conf is not None:
            conf.append(p.gather(1, ids.view(-1, 1)).view(B, k).float())
        if head.truncated:  # the draft vocabulary's probabilities at their target ids, zero elsewhere
            if getattr(self, "_draft_vocab_ids", None) is None:
                self._draft_vocab_ids = head.to_target_ids(torch.arange(p.shape[-1], device=p.device))
            full = p.new_zeros(B * k, self.vllm_config.model_config.get_vocab_size())
            p = full.index_copy_(1, self._draft_vocab_ids, p)
        probs.append(p.view(B, k, -1))
        return head.to_target_ids(ids).view(B, k)

    def _req_ids(self, B: int) -> list[str | None]:
        batch = getattr(self._runner, "input_batch", None)
        ids = list(getattr(batch, "req_ids", None) or [])[:B]
        return ids + [None] * (B - len(ids))
