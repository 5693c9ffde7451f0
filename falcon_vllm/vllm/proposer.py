"""FalconProposer: semi-autoregressive chain drafting on vLLM's paged KV cache.

vLLM's V1 runner instantiates ``EagleProposer`` for ``method == "eagle"``; the plugin replaces that
name with this subclass, which delegates to stock EAGLE unless the draft config carries a
``falcon`` section.  For a Falcon drafter one step drafts K tokens in ``ceil(K / k)`` passes:

* pass 0 (stock EAGLE first pass, causal): every token the target just verified is fed to the
  drafter, writing its KV cache;
* pass 1 (the relaxed block): the last k committed drafter positions of each request are run again
  as one non-causal block, so each sees the whole block (the end-aligned relaxed mask the drafter
  was trained with); its k outputs give draft tokens 1..k.  When fewer than k positions are new in
  this step (``a + 1 < k``) the older ones come from a per-request stash of the previous step's
  last k-1 (token, target feature) pairs;
* passes 2..: one k-token block per request, input tokens = the previous block's drafted tokens,
  input features = the previous block's output features, at the next k positions, attending to
  the paged prefix, the earlier blocks and (non-causally) itself.

The drafted chain is verified by vLLM's own rejection sampler, so the output is exactly vanilla
vLLM's (greedy) or lossless (sampling) whatever the drafter does.  ``passes`` / ``steps`` count
drafter forwards so tests and logs can check ``ceil(K / k)`` per step.
"""

from __future__ import annotations

import math

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.v1.spec_decode.eagle import EagleProposer

logger = init_logger(__name__)
PADDING_SLOT_ID = -1


def falcon_section(draft_model_config) -> dict | None:
    if draft_model_config is None:
        return None
    f = getattr(draft_model_config.hf_config, "falcon", None)
    return dict(f) if isinstance(f, dict) else None


class FalconProposer(EagleProposer):
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self._runner = runner  # for request ids (the per-request stash)
        self.falcon = falcon_section(self.speculative_config.draft_model_config)
        self.k = int(self.falcon["k"]) if self.falcon else 1
        self.steps = 0          # propose() calls
        self.passes = 0         # drafter forwards that produced draft tokens (relaxed block + block passes)
        self._stash: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.falcon:
            logger.info("falcon-vllm: Falcon proposer active (k=%d, K=%d -> %d drafter passes per step)",
                        self.k, self.num_speculative_tokens,
                        math.ceil(self.num_speculative_tokens / self.k))

    # ------------------------------------------------------------------ helpers
    def _slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """positions [B, T] -> flat KV slots [B*T] (PADDING for positions past the context)."""
        bs = self.block_size
        pos = positions.clamp(max=self.max_model_len - 1).long()
        blk = block_table.long().gather(1, (pos // bs).clamp(max=block_table.shape[1] - 1))
        slots = blk * bs + pos % bs
        slots = torch.where(positions >= self.max_model_len, torch.full_like(slots, PADDING_SLOT_ID), slots)
        return slots.reshape(-1)

    def _block_pass(self, cad, ids, feats, positions):
        """Run one non-causal k-token block per request.

        ids [B, k] int; feats [B, k, H]; positions [B, k] (consecutive).  Returns (out [B, k, H]).
        """
        B, k = ids.shape
        n = B * k
        qsl = torch.arange(0, n + 1, k, dtype=torch.int32, device=ids.device)
        seq_lens = (positions[:, -1] + 1).clamp(max=self.max_model_len).to(torch.int32)
        slot_mapping = self._slots(cad.block_table_tensor, positions)
        blk_cad = cad.replace(
            query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq_lens,
            num_actual_tokens=n, max_query_len=k, max_seq_len=int(seq_lens.max()),
            slot_mapping=slot_mapping, causal=False,
            seq_lens_cpu_upper_bound=seq_lens.cpu() if cad.seq_lens_cpu_upper_bound is not None else None)
        _, per_layer = self.build_per_group_and_layer_attn_metadata(blk_cad, draft_index=1)
        self.input_ids[:n] = ids.reshape(-1).to(self.input_ids.dtype)
        self.positions[:n] = positions.clamp(max=self.max_model_len - 1).reshape(-1).to(self.positions.dtype)
        self.hidden_states[:n] = feats.reshape(n, -1)
        with set_forward_context(per_layer, self.vllm_config, num_tokens=n,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 slot_mapping=self._get_slot_mapping(n, slot_mapping)):
            out, _ = self.model(input_ids=self.input_ids[:n], positions=self.positions[:n],
                                hidden_states=self.hidden_states[:n])
        self.passes += 1
        return out[:n].view(B, k, -1)

    def _draft_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        B, k, H = rows.shape
        return self.model.compute_logits(rows.reshape(B * k, H)).argmax(-1).view(B, k)

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
        self._last_draft_probs = None
        k = self.k
        cad = common_attn_metadata
        B = cad.batch_size()

        # pass 0: stock causal chunk pass over every verified token (writes the drafter KV cache)
        num_tokens, last, cad = self.set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids,
            target_positions=target_positions, target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample, cad=cad,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu)
        _, per_layer = self.build_per_group_and_layer_attn_metadata(cad)
        with set_forward_context(per_layer, self.vllm_config, num_tokens=num_tokens,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 slot_mapping=self._get_slot_mapping(num_tokens, cad.slot_mapping)):
            self.model(input_ids=self.input_ids[:num_tokens], positions=self._get_positions(num_tokens),
                       hidden_states=self.hidden_states[:num_tokens])
        if num_speculative_tokens == 0:
            return torch.empty(B, 0, dtype=torch.int64, device=self.device)
        self.steps += 1

        # pass 1: the last k committed positions as one relaxed block
        last = last.long()
        start = cad.query_start_loc[:B].long()
        offs = torch.arange(k - 1, -1, -1, device=last.device)           # k-1 .. 0
        idx = last[:, None] - offs[None]                                  # [B, k]
        valid = idx >= start[:, None]
        safe = torch.where(valid, idx, last[:, None].expand_as(idx))
        ids = self.input_ids[safe].clone()
        feats = self.hidden_states[safe].clone()
        last_pos = self.positions[last].long()
        positions = last_pos[:, None] - offs[None]
        if not bool(valid.all()):
            self._fill_from_stash(ids, feats, valid)
        positions = positions.clamp(min=0)
        rows = self._block_pass(cad, ids, feats, positions)
        self._update_stash(ids, feats)
        drafted = [self._draft_tokens(rows)]

        # passes 2..: one k-token block per request on top of the previous block
        for q in range(1, math.ceil(num_speculative_tokens / k)):
            positions = last_pos[:, None] + 1 + k * (q - 1) + torch.arange(k, device=last.device)[None]
            rows = self._block_pass(cad, drafted[-1], rows, positions)
            drafted.append(self._draft_tokens(rows))
        return torch.cat(drafted, dim=1)[:, :num_speculative_tokens].to(torch.int64)

    # ------------------------------------------------------------------ stash of the last k-1 inputs
    def _req_ids(self, B: int) -> list[str] | None:
        batch = getattr(self._runner, "input_batch", None)
        ids = getattr(batch, "req_ids", None)
        return list(ids[:B]) if ids is not None else None

    def _fill_from_stash(self, ids, feats, valid):
        """Rows whose position predates this step come from the previous step's block inputs."""
        req_ids = self._req_ids(ids.shape[0])
        for b in (~valid).any(1).nonzero().flatten().tolist():
            need = int((~valid[b]).sum())
            st = self._stash.get(req_ids[b]) if req_ids else None
            if st is None or st[0].shape[0] < need:
                continue  # no history (e.g. a prompt shorter than k): keep the duplicated rows
            ids[b, :need] = st[0][-need:]
            feats[b, :need] = st[1][-need:]

    def _update_stash(self, ids, feats):
        req_ids = self._req_ids(ids.shape[0])
        if not req_ids or self.k == 1:
            return
        live = set(req_ids)
        for r in [r for r in self._stash if r not in live]:
            del self._stash[r]
        for b, r in enumerate(req_ids):
            self._stash[r] = (ids[b, 1:].clone(), feats[b, 1:].clone())
