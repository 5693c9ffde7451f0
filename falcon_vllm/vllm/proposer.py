"""FalconProposer: the V1 runner's adapter of the Falcon drafting core (:mod:`falcon_vllm.core.drafting`).

vLLM's V1 runner instantiates ``EagleProposer`` for ``method == "eagle"``; the plugin replaces that name with
this subclass, which delegates to stock EAGLE unless the draft config carries a ``falcon`` section.  It turns
the runner's objects (``CommonAttentionMetadata``, the input batch, the sampling metadata) into the core's
plain inputs, runs the drafter's passes the core lays out under vLLM attention metadata it builds, and hands
back what vLLM expects.  The algorithm: ``docs/design.md`` ("Chain mode", "The drafting core").

One chain step, k = 2, K = 4; request a verified positions 7..9 (two drafts accepted), request b position 4
(none accepted: its position 3 was verified a step earlier); drafter row j holds (x_{j+1}, f_j)::

    chunk rows (this step's, stock EAGLE layout)   a: 7 8 9        b: 4
    causal chunk group (rows before the block)     a: 7            b: -
    relaxed block (last k committed, non-causal)   a: [8 9]        b: [3 4]
      inputs from                                  a: chunk        b: 3 stash, 4 chunk
    pass 1 (CPU: fused with the causal groups)     a: x11 x12      b: x6 x7      block row r -> draft r+1
    pass 2: block at p+1 .., inputs = pass 1's     a: [10 11]      b: [5 6]
      tokens and output features                   a: x13 x14      b: x8 x9      -> drafts [B, K]

(x10 and x5 are the tokens the target just sampled; a row of the block whose inputs are unknown runs but
writes no K/V.)  Tree mode runs the same chunk pass and relaxed block, then ``DecodingTree.draft``'s passes.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.spec_decode.eagle import EagleProposer

from falcon_vllm.tree import DecodingTree
from falcon_vllm.vllm import attention_hook, patches, prefix_gaps, tree_verify
from falcon_vllm.core.drafting import FalconDrafting
from falcon_vllm.vllm.live import falcon_proposer, falcon_section, proposer_class
from falcon_vllm.vllm.model import wrap_gemms
from falcon_vllm.vllm.options import check_async_scheduling, check_cudagraph_mode
from falcon_vllm.core.paged_kv import tree_attention_scope
from falcon_vllm.core.tree_draft import TreeState

__all__ = ["FalconProposer", "falcon_proposer", "falcon_section", "unwrap_model"]
logger = init_logger(__name__)


def unwrap_model(model):
    while hasattr(model, "unwrap"):
        model = model.unwrap()
    return model


@proposer_class
class FalconProposer(EagleProposer, FalconDrafting):
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.init_drafting(falcon_section(self.speculative_config.draft_model_config))
        if not self.falcon:
            return
        # the config hook turns async scheduling off for ragged drafts; a config built another way is refused here
        check_async_scheduling(self.falcon, vllm_config.scheduler_config.async_scheduling)
        self.init_lookup()
        if self.falcon.mode == "tree":
            self.tree = DecodingTree(self.falcon.tree, self.k, self.falcon.tree_name)
            # the config hook chose PIECEWISE where unset; this catches a VllmConfig built without EngineArgs
            check_cudagraph_mode(self.falcon, vllm_config.compilation_config.cudagraph_mode)
            self.tree_state = TreeState(self.tree, self.falcon.subtrees)
        if self.uses_mrope:
            raise NotImplementedError("falcon-vllm: targets with M-RoPE positions are not supported")
        self._runner = runner  # its input batch gives the request ids (for the stash)
        # chunk pass + relaxed block in one drafter pass: needs per-request causal flags, which vLLM's CPU
        # attention implements (its FlashAttention only from FA4): elsewhere the two passes run separately
        self.fuse_chunk = current_platform.is_cpu()
        self.init_stash(self.max_batch_size, self.hidden_size, device, self.dtype, self.input_ids.dtype)
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
            patches.check_instances(self._runner, self.vllm_config,
                                    probe=attention_hook.probe_layout if self.tree is not None else None)
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
        self.num_speculative_tokens = num_speculative_tokens
        K = self.chain_budget(num_speculative_tokens)
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
        # draft_sample_method "probabilistic": the drafts' distributions go to vLLM's rejection sampler
        want_probs = self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy
        drafts = self.draft_step(cad, K, num_tokens, last, B, sampling_metadata, want_probs)
        self._last_draft_probs = self.draft_probs  # (take_last_draft_probs)
        return drafts

    # ------------------------------------------------------------------ the core's passes (cad: the step's)
    def _relaxed_block_inputs(self, cad, last: torch.Tensor, B: int):
        return self.block_inputs(cad.query_start_loc[:B], last, self._req_ids(B))

    def _defer(self, cad, last: torch.Tensor, B: int) -> bool:
        return self.defer_rows_of(cad.query_start_loc_cpu[:B].tolist(), last, self._req_ids(B))

    def _chunk_pass(self, cad, num_tokens: int, positions: torch.Tensor) -> None:
        """Stock EAGLE's causal pass over the chunk rows as they lie (writes their drafter K/V)."""
        self._set_offsets(self.chunk_offsets(cad.query_start_loc, num_tokens, positions))
        self._forward(self.build_per_group_and_layer_attn_metadata(cad)[1], num_tokens, cad.slot_mapping)

    def _fused_pass(self, cad, num_tokens: int, last: torch.Tensor, ids, feats, positions, known) -> torch.Tensor:
        """The chunk pass and the relaxed block in one drafter pass (``plan_fused``); returns the blocks'
        outputs [B, k, H].  The query groups are told apart by vLLM's per-request causal flags
        (``CommonAttentionMetadata.causal`` as a tensor; the CPU attention backend implements them).  Within a
        layer every row's K/V is written before any row attends, so a block sees its chunk's rows as separate
        passes would: the outputs equal the two passes', and the drafter's weights are read once per step."""
        B = ids.shape[0]
        plan = self.plan_fused(num_tokens, cad.query_start_loc, last, (ids, feats, positions, known),
                               cad.slot_mapping, cad.seq_lens, cad.block_table_tensor)
        upper = cad.seq_lens_cpu_upper_bound
        fused = cad.replace(
            query_start_loc=plan.query_start_cpu.to(ids.device, non_blocking=True),
            query_start_loc_cpu=plan.query_start_cpu, seq_lens=plan.seq_lens, num_reqs=len(plan.seq_lens),
            num_actual_tokens=plan.num_rows, max_query_len=plan.max_query_len, block_table_tensor=plan.block_table,
            slot_mapping=plan.slot_mapping, causal=plan.causal,
            seq_lens_cpu_upper_bound=None if upper is None else torch.cat([upper[plan.chunked], upper[:B]]),
            positions=None if cad.positions is None else plan.positions,
            _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)
        _, per_layer = self.build_per_group_and_layer_attn_metadata(fused)
        self._set_offsets(plan.offsets)
        out = self._forward(per_layer, plan.num_rows, plan.slot_mapping)
        return self.block_outputs(out[plan.num_chunk_rows:plan.num_rows], B)

    def _block_pass(self, cad, ids, feats, positions, writes, extra_len: int) -> torch.Tensor:
        """One non-causal k-token block per request (``plan_block``); returns the output features [B, k, H].
        ``extra_len``: how far the block's end lies past the relaxed block's end (bounds the context length
        without a device sync)."""
        plan = self.plan_block(cad.block_table_tensor, ids, feats, positions, writes)
        upper = cad.seq_lens_cpu_upper_bound
        blk_cad = cad.replace(
            query_start_loc=plan.query_start_cpu.to(ids.device, non_blocking=True),
            query_start_loc_cpu=plan.query_start_cpu, seq_lens=plan.seq_lens, num_actual_tokens=plan.num_rows,
            max_query_len=self.k, max_seq_len=min(cad.max_seq_len + extra_len, self.max_model_len),
            slot_mapping=plan.slot_mapping, causal=False,
            seq_lens_cpu_upper_bound=None if upper is None else (upper + extra_len).clamp(max=self.max_model_len),
            positions=None if cad.positions is None else plan.positions,
            _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)
        _, per_layer = self.build_per_group_and_layer_attn_metadata(blk_cad, draft_index=1)
        self._set_offsets(plan.offsets)
        out = self._forward(per_layer, plan.num_rows, plan.slot_mapping)
        self.passes += 1
        return self.block_outputs(out[:plan.num_rows], ids.shape[0])

    def _draft_tree(self, cad, rows: torch.Tensor, positions: torch.Tensor, K: int) -> torch.Tensor:
        return self.draft_tree(rows, positions, K, cad.block_table_tensor, cad.max_seq_len)

    def _tree_block_pass(self, attn, ids, feats, positions) -> torch.Tensor:
        """One drafter pass over tree blocks [NB, k]; attention by ``attn`` (no paged-cache writes)."""
        NB, k = ids.shape
        n = NB * k
        flat_pos = positions.clamp(0, self.max_model_len - 1).reshape(-1)
        self._set_rows(0, ids, feats, flat_pos)
        self._set_offsets(self.block_offsets(NB, ids.device))
        per_layer = {name: None for name in self._draft_attn_layer_names}
        with tree_attention_scope(attn), set_forward_context(per_layer, self.vllm_config, num_tokens=n,
                                                             cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                                             slot_mapping={}):
            out, _ = self.model(input_ids=self.input_ids[:n], positions=self.positions[:n],
                                hidden_states=self.hidden_states[:n])
        self.passes += 1
        return self.block_outputs(out[:n], NB)

    def _topk(self, rows: torch.Tensor, topk: int) -> torch.Tensor:
        """rows [B, R, H] -> the drafter's top candidates [B, R, topk] (rank order)."""
        B, R, H = rows.shape
        ids = self.model.compute_logits(rows.reshape(B * R, H)).topk(topk, dim=-1).indices
        return unwrap_model(self.model).to_target_ids(ids).view(B, R, topk)

    def _draft(self, rows: torch.Tensor, sampling_metadata=None, probs: list | None = None,
               conf: list | None = None) -> torch.Tensor:
        """rows [B, k, H] -> draft tokens [B, k] (target ids), by ``FalconDrafting.draft_tokens``."""
        B, k, H = rows.shape
        logits = self.model.compute_logits(rows.reshape(B * k, H))
        return self.draft_tokens(logits, B, unwrap_model(self.model), sampling_metadata, probs, conf,
                                 self.vllm_config.model_config.get_vocab_size() if probs is not None else None)

    def sample_logits(self, logits: torch.Tensor, sampling_metadata):
        """vLLM's draft sampling: (token ids [R], probabilities [R, V']) at each request's temperature."""
        return self._sample_from_logits(logits, sampling_metadata)

    def _set_offsets(self, offsets: torch.Tensor | None) -> None:
        if offsets is not None:
            unwrap_model(self.model).model.set_level_offsets(offsets)

    def _forward(self, per_layer, n: int, slot_mapping) -> torch.Tensor:
        """The drafter over its input rows' first ``n`` (no CUDA graph), writing K/V at ``slot_mapping``."""
        with set_forward_context(per_layer, self.vllm_config, num_tokens=n, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 slot_mapping=self._get_slot_mapping(n, slot_mapping)):
            out, _ = self.model(input_ids=self.input_ids[:n], positions=self._get_positions(n),
                                hidden_states=self.hidden_states[:n])
        return out

    # ------------------------------------------------------------------ the runner's requests
    def _req_ids(self, B: int) -> list[str | None]:
        batch = getattr(self._runner, "input_batch", None)
        ids = list(getattr(batch, "req_ids", None) or [])[:B]
        return ids + [None] * (B - len(ids))

    def blocks_of(self, req_id: str, first: int, stop: int):
        return prefix_gaps.blocks_of(self._runner, req_id, first, stop)

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
            if n > 0 and self.keep_rows(s, r, torch.from_numpy(after[:n].astype(np.int64)),
                                        hidden_states[qsl[i]:qsl[i] + n].clone(), first):
                kept.add(r)
        return kept

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
