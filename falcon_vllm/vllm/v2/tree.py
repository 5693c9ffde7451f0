"""Tree mode on Model Runner V2: the target's side (node positions, ancestor-mask attention, tree sampler, K/V
compaction), through one model state of the plugin's own; no runner method is wrapped.

V2 asks the target model for its model-state class (``get_model_state_cls``) right after the speculator has
loaded, so :class:`~falcon_vllm.vllm.v2.speculator.FalconSpeculator` sets that on the target in tree mode, and
:func:`tree_model_state` subclasses the class V2 would have chosen:

1. **Schedule.** The speculator drafted the tree's N node tokens per request; V2 schedules them as the request's
   speculative tokens and runs ``[root] + nodes``, written to consecutive KV slots as for a chain.
2. ``prepare_inputs``: the node tokens' positions become root position + depth (a positions tensor of the model
   state's own: V2's, and the slot mappings computed from them, stay consecutive), and the forward's ancestor-mask
   attention (:func:`falcon_vllm.vllm.tree_verify.plan_tree_rows`, the V1 runner's) is switched on for the
   target forward that follows.
3. ``custom_sampler``: :class:`TreeSampler` takes V2's rejection sampler's place.  It switches the tree attention
   off, samples every request's root row with V2's own sampler (exactly a non-speculative step), verifies each tree
   (greedy, or lossless recursive rejection sampling at the request's temperature, top-k and top-p: the V1 tree
   sampler's :func:`~falcon_vllm.vllm.tree_verify.verify_requests`) and returns V2's outputs: the accepted path and
   the bonus token, ``num_sampled`` = a + 1, ``num_rejected`` = N - a.
4. **Compact.** The accepted nodes' target K/V move to the slots right after the root and their input ids to the
   rows after it; the speculator moves their hidden states the same way before its chunk pass.  From there V2 sees
   a chain step that accepted ``a`` tokens.

A step the tree sampler cannot serve exactly verifies nothing: every request emits its root row's sample from
V2's sampler (:meth:`TreeSampler.plain_only`).  That is the case when a request of the batch needs more than
temperature, top-k and top-p (logits processors, penalties, bad words, logit bias, min-p, thinking budgets, a
grammar), asks for logprobs, or is seeded at a temperature above 0 (V2 keys its draws by seed and position, not by
the tree's path); the speculator drafts nothing for such a batch (:meth:`TreeSampler.servable`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from falcon_vllm.core.drafting import SAMPLING_EPS
from falcon_vllm.core.paged_kv import _ACTIVE
from falcon_vllm.vllm.tree_compaction import compact_kv, target_kv_caches
from falcon_vllm.vllm.tree_verify import plan_tree_rows, verify_requests



@dataclasses.dataclass
class TreeStepV2:
    """What the sampler needs from ``prepare_inputs`` of a tree step."""

    root_rows: np.ndarray  # [num_reqs] token row of each request's root (-1: no tree)
    widths: np.ndarray     # [num_reqs] tree nodes scheduled (0: no tree)
    token: object = None   # the attention scope's context-variable token (reset by the sampler)


def tree_model_state(base: type, speculator) -> type:
    """A subclass of V2's model state ``base`` serving ``speculator``'s tree steps."""

    class FalconTreeModelState(base):
        def prepare_inputs(self, input_batch, req_states):
            inputs = super().prepare_inputs(input_batch, req_states)
            speculator.tree_step = None
            widths = input_batch.num_draft_tokens_per_req
            if input_batch.num_draft_tokens == 0 or widths is None or "positions" in inputs:
                return inputs
            widths = np.asarray(widths[:input_batch.num_reqs], dtype=np.int64)
            n_sched = np.asarray(input_batch.num_scheduled_tokens[:input_batch.num_reqs], dtype=np.int64)
            positions = input_batch.positions.clone()
            root_rows, attention = plan_tree_rows(speculator.tree_state, widths, n_sched, positions)
            step = TreeStepV2(root_rows, widths)
            if attention is not None:
                step.token = _ACTIVE.set(attention)  # the target forward that follows runs under it
                inputs = {**inputs, "positions": positions}
            speculator.tree_step = step
            return inputs

        def custom_sampler(self, sampler):
            speculator.tree_sampler = TreeSampler(sampler, speculator)
            return sampler, speculator.tree_sampler

    FalconTreeModelState.__qualname__ = f"FalconTree{base.__name__}"
    return FalconTreeModelState


class TreeSampler:
    """V2's rejection sampler in tree mode (called as ``(logits, input_batch, *draft_logits_etc)``)."""

    enable_adaptive_verification = False  # read by V2's warm-up

    def __init__(self, sampler, speculator):
        self.sampler = sampler
        self.speculator = speculator
        # per request-state row: whether the tree sampler verifies it exactly (set as V2 adds each request)
        self.exact = np.zeros(len(sampler.sampling_states.seeds_set), dtype=bool)
        # engine-wide logits processors beyond V2's own three may touch any request: no trees at all
        self.custom_processors = len(getattr(sampler, "logits_processors", ())) > 3
        add = sampler.add_request

        def add_request(req_idx: int, sampling_params) -> None:
            add(req_idx, sampling_params)
            self.exact[req_idx] = exact_params(sampling_params)

        sampler.add_request = add_request

    # ------------------------------------------------------------------ which batches a tree serves exactly
    def servable(self, input_batch) -> bool:
        """Whether the tree sampler verifies every request of the batch exactly (``exact_params``; no grammar, no
        engine-wide logits processor); else the speculator drafts nothing this step."""
        if self.custom_processors or getattr(input_batch, "has_structured_output_reqs", False):
            return False
        return bool(self.exact[np.asarray(input_batch.idx_mapping_np[:input_batch.num_reqs])].all())

    # ------------------------------------------------------------------ one step
    def __call__(self, logits: torch.Tensor, input_batch, *rest):
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        step, self.speculator.tree_step = self.speculator.tree_step, None
        if step is not None and step.token is not None:
            _ACTIVE.reset(step.token)
        B = input_batch.num_reqs
        cu = np.asarray(input_batch.cu_num_logits_np[:B + 1], dtype=np.int64)
        widths = cu[1:] - cu[:-1] - 1                                  # nodes verified per request
        roots = self.plain(logits, input_batch, cu)
        K = self.speculator.num_speculative_steps
        out = torch.full((B, K + 1), -1, dtype=torch.int64, device=logits.device)
        out[:, 0] = roots.sampled_token_ids[:, 0].to(torch.int64)
        num_sampled = roots.num_sampled.clone()
        paths: dict[int, list[int]] = {}
        if widths.any() and self.servable(input_batch):
            paths = self.verify(logits, input_batch, cu, widths, out, num_sampled)
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled, input_batch.seq_lens, input_batch.cu_num_logits, input_batch.idx_mapping,
            self.sampler.req_states.prefill_len.gpu)
        if paths:
            self.compact(input_batch, cu, paths)
        self.speculator.tree_paths = (cu, paths)
        self.speculator.tree_state.record(widths, paths)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=roots.logprobs_tensors,
                             num_nans=roots.num_nans, num_sampled=num_sampled, num_rejected=num_rejected)

    def plain(self, logits: torch.Tensor, input_batch, cu: np.ndarray):
        """V2's own sampler on every request's root row: exactly what a step without drafts samples."""
        B = input_batch.num_reqs
        dev = logits.device
        root_logit_rows = torch.from_numpy(cu[:-1]).to(dev)
        one = torch.arange(B + 1, dtype=input_batch.cu_num_logits.dtype, device=dev)
        roots = dataclasses.replace(
            input_batch, logits_indices=input_batch.logits_indices[root_logit_rows],
            cu_num_logits=one, cu_num_logits_np=np.arange(B + 1, dtype=input_batch.cu_num_logits_np.dtype),
            expanded_idx_mapping=input_batch.idx_mapping[:B],
            expanded_local_pos=torch.zeros_like(input_batch.expanded_local_pos[:B]))
        return self.sampler(logits[root_logit_rows], roots)

    def verify(self, logits, input_batch, cu, widths, out, num_sampled) -> dict[int, list[int]]:
        """Each tree request's accepted path (greedy, or lossless sampling), into ``out`` and ``num_sampled``."""
        state = self.speculator.tree_state
        dev = logits.device
        states = self.sampler.sampling_states
        idx = torch.as_tensor(np.asarray(input_batch.idx_mapping_np[:len(widths)]), device=dev)
        temp = states.temperature.gpu[idx]
        greedy = states.temperature.np[np.asarray(input_batch.idx_mapping_np[:len(widths)])] < SAMPLING_EPS
        top_k, top_p = states.top_k.gpu[idx], states.top_p.gpu[idx]
        vocab = logits.shape[-1]
        ids = input_batch.input_ids[input_batch.logits_indices]       # each logits row's input token
        argmax = logits.argmax(-1) if greedy.any() else None
        groups: dict[tuple[int, bool], list[int]] = {}
        for r in np.nonzero(widths)[0].tolist():
            groups.setdefault((int(widths[r]), bool(greedy[r])), []).append(r)
        paths = {}
        for (w, is_greedy), reqs in groups.items():
            sel = torch.tensor(reqs, dtype=torch.long, device=dev)
            starts = torch.from_numpy(cu[reqs]).to(dev)
            nodes = ids[starts[:, None] + 1 + torch.arange(w, device=dev)].long()   # [G, w]
            if is_greedy:
                toks, accepted = verify_requests(state.drafted(w), nodes, logits, starts, argmax=argmax)
            else:
                tk = top_k[sel]
                tk = torch.where((tk <= 0) | (tk >= vocab), 0, tk)
                tp = top_p[sel]
                toks, accepted = verify_requests(state.drafted(w), nodes, logits, starts, temp[sel],
                                                 tk if bool((tk > 0).any()) else None,
                                                 tp if bool((tp < 1).any()) else None)
            out[sel, : w + 1] = toks.to(out.dtype)
            num_sampled[sel] = torch.tensor([len(a) + 1 for a in accepted], dtype=num_sampled.dtype, device=dev)
            for r, a in zip(reqs, accepted):
                if a:
                    paths[r] = a
        return paths

    def compact(self, input_batch, cu, paths: dict[int, list[int]]) -> None:
        """The accepted nodes' target K/V into the slots after the root, their input ids into the rows after it."""
        src, dst, src_pos, dst_pos, reqs = [], [], [], [], []
        qsl = input_batch.query_start_loc_np
        for r, path in paths.items():
            root = int(qsl[r + 1]) - (int(cu[r + 1] - cu[r]))          # the root's row in the step's tokens
            for i, s in enumerate(path):
                if s != i + 1:  # already in place otherwise (decided on the host)
                    src.append(root + s)
                    dst.append(root + 1 + i)
                    src_pos.append(s)
                    dst_pos.append(i + 1)
                    reqs.append(r)
        if not src:
            return
        spec = self.speculator
        dev = input_batch.input_ids.device
        src_t, dst_t = (torch.tensor(x, dtype=torch.long, device=dev) for x in (src, dst))
        root_pos = input_batch.positions[torch.tensor([int(qsl[r + 1]) - int(cu[r + 1] - cu[r]) for r in reqs],
                                                      dtype=torch.long, device=dev)].long()
        table = spec.block_tables.input_block_tables[0][torch.tensor(reqs, dtype=torch.long, device=dev)]
        slots_src = spec.kv_slots(table, (root_pos + torch.tensor(src_pos, device=dev))[:, None])
        slots_dst = spec.kv_slots(table, (root_pos + torch.tensor(dst_pos, device=dev))[:, None])
        compact_kv(target_kv_caches(spec.vllm_config, spec.draft_attn_layer_names), slots_src, slots_dst,
                   state=spec.tree_state)
        input_batch.input_ids[dst_t] = input_batch.input_ids[src_t]


def exact_params(sp) -> bool:
    """Whether the tree sampler computes exactly what V2's sampler would for a request with these sampling params:
    temperature, top-k and top-p only, no logprobs, and no seed at a temperature above 0 (V2 keys its draws by seed
    and position, so a seeded request's tokens would depend on its drafts); the V1 tree sampler's rule
    (``tree_verify.tree_drafts_for``) plus logprobs, which V2's tree step does not return per node."""
    from falcon_vllm.vllm.tree_verify import tree_drafts_for

    return (tree_drafts_for(sp) and sp.logprobs is None and sp.prompt_logprobs is None
            and not getattr(sp, "logprob_token_ids", None))
