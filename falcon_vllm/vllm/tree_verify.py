"""Tree mode, the target's side: the decoding tree verified in one target pass of vLLM's V1 runner.

A step of tree mode (the drafter's side is in :mod:`falcon_vllm.core.tree_draft` and
:mod:`falcon_vllm.vllm.proposer`; the state is the proposer's :class:`~falcon_vllm.core.tree_draft.TreeState`):

1. **Schedule.** The Falcon proposer drafted the tree's N node tokens per request; vLLM schedules
   them as the request's N speculative tokens, so the target runs ``[root] + nodes`` (1 + N
   tokens, written to consecutive KV slots as for a chain).
2. ``_prepare_inputs`` (wrapped): the positions of the node tokens are rewritten to
   ``root position + depth`` and the step's :class:`TreeStep` (with its attention) is built.
3. **Verify.** ``_model_forward`` (wrapped) runs the target under the step's
   :class:`VerifyTreeAttention`: every token's attention is computed once.  When the batch holds
   only trees and short queries, the tree path serves every row (tree requests over the paged
   prefix plus their in-flight tokens under the ancestor mask, the others causally) and the stock
   kernel is skipped (CUDA: the Triton kernel of ``kernels/tree_attention.py``; CPU_ATTN: one gather
   of K^T/V rows from the paged cache and a few batched ops per layer).  A batch with a prefill chunk
   runs the stock kernel and recomputes the tree requests' rows only.
4. ``_sample`` (wrapped): the tree sampler (greedy or lossless recursive rejection sampling from
   :mod:`falcon_vllm.verify`) replaces vLLM's chain rejection sampler and emits the accepted
   path's tokens + the bonus token in vLLM's output format.
5. **Compact.** The accepted nodes' target K/V are copied into the slots right after the root, and
   the runner's per-token buffers (input ids, positions, target hidden states) are reordered the
   same way.  From here on the step is indistinguishable from a chain step that accepted ``a``
   tokens: vLLM's rollback (``num_computed -= N - a``), prefix caching, metrics and the drafter's
   next chunk pass (which rewrites the drafter's K/V for the accepted positions) all stay correct.
   On CUDA the compaction is one launch of ``kernels/kv_compaction.py`` for all layers; the tree
   sampler copies logits in bounded chunks (:mod:`falcon_vllm.vllm.tree_compaction`).

Models and settings tree mode cannot serve exactly are refused at start-up (:mod:`falcon_vllm.vllm.tree_startup`).
All hooks check for the proposer's tree state; runners without a Falcon tree are untouched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from falcon_vllm.kernels.tree_attention import tree_attention_ref, unpack_tree_bits
from falcon_vllm.tree import DecodingTree
from falcon_vllm.verify import greedy_verify_argmax, probs_from_logits, sample_tokens, sample_verify
from falcon_vllm.vllm import patches
from falcon_vllm.core.drafting import SAMPLING_EPS
from falcon_vllm.vllm.live import falcon_proposer
from falcon_vllm.core.paged_kv import kv_layout, paged_kv, to_device, tree_attention_scope
from falcon_vllm.vllm.tree_compaction import _use_compaction_kernel, compact, compact_kv  # noqa: F401 (tests')
from falcon_vllm.core.tree_draft import TreeState, cuda_tree_kernel
from falcon_vllm.vllm.tree_startup import _unsupported, check_startup  # noqa: F401 (tests' and the proposer's)



# ---------------------------------------------------------------------------- target attention
def _attn_fn(q: torch.Tensor):
    return cuda_tree_kernel(q) or tree_attention_ref


# ---------------------------------------------------------------------------- attention contexts
# A request without a tree whose query is at most this long (a decode row, a short chunk) is served by the
# tree-attention path with a causal mask, so the stock kernel can be skipped for the whole batch; a batch
# holding a longer query (a prefill chunk) runs the stock kernel and recomputes only the tree rows.
MAX_CAUSAL_ROWS = 64
# CPU tree attention: requests padded to at least this many rows use PyTorch's fused (tiled) attention;
# fewer rows, batched matmuls (faster than SDPA at a few rows, slower once the [rows, keys] intermediates outgrow
# the cache: the measurement is in docs/findings.md)
SDPA_MIN_ROWS = 48


class VerifyTreeAttention:
    """Target attention of a tree step, computed once per token.

    ``whole`` (the usual case: every request is a tree or a short causal query): the tree path
    serves every row of the batch (non-tree requests under a causal mask) and the stock kernel is
    skipped.  Otherwise (a prefill chunk in the batch) the stock kernel runs and only the tree
    requests' rows are recomputed under their ancestor mask.  No host sync inside a layer: the query
    lengths are known on the host, the longest prefix is bounded by the metadata's ``max_seq_len``.
    """

    def __init__(self, rows, req_idx, qsl, bits, device, whole: bool):
        self.whole = whole
        self.total = int(qsl[-1])
        qlens = np.diff(qsl)
        host = [torch.as_tensor(qlens, dtype=torch.int32), torch.as_tensor(qsl, dtype=torch.int32), bits]
        if not whole:  # token rows (root first) and the request of each tree
            host += [torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(req_idx, dtype=torch.long)]
        moved = to_device(host, device)
        self.qlens, self.qsl, self.bits = moved[:3]
        self.rows, self.req_idx = ((slice(0, self.total), slice(0, len(qsl) - 1)) if whole else moved[3:])
        self.max_w = int(qlens.max())
        self._md = None  # the metadata the cached prefix lengths / block table belong to
        self._prefix = self._table = None

    @property
    def alone(self) -> bool:  # see paged_kv.tree_attention_scope
        return self.whole

    def wants(self, md) -> bool:
        return md is not None  # vLLM's dummy/profile forwards carry no metadata

    def attend(self, impl, layer, q, k, v, kv_cache, md, output):
        H, D = q.shape[1], q.shape[2]
        if self._md is not md:  # once per KV-cache group and forward, not per layer
            self._md = md
            self._prefix = (md.seq_lens[self.req_idx] - self.qlens).to(torch.int32)
            self._table = md.block_table[self.req_idx]
        out = output.view(-1, H, D)
        n = self.total
        layout = kv_layout(impl, layer)
        if self.whole and layout == "cpu":  # CPU_ATTN: the whole batch in a few batched ops per layer
            out[:n] = self._dense(q, kv_cache, impl.scale).to(out.dtype)
            return
        kc, vc = paged_kv(kv_cache, layout)
        if self.whole:
            _attn_fn(q)(q[:n], k[:n], v[:n], kc, vc, self._table, self._prefix, self.qsl, self.bits, impl.scale,
                        out=out[:n], max_query_len=self.max_w, max_prefix_len=int(md.max_seq_len))
            return
        res = _attn_fn(q)(q[self.rows], k[self.rows], v[self.rows], kc, vc, self._table, self._prefix, self.qsl,
                          self.bits, impl.scale, max_query_len=self.max_w, max_prefix_len=int(md.max_seq_len))
        out[self.rows] = res.to(output.dtype)

    def _cpu_plan(self, kv_cache: torch.Tensor, heads: int):
        """Per forward (CPU, whole batch): rows of the paged cache to gather, query padding, additive mask.

        The CPU cache of a layer is [blocks, Hkv, bs, 2 * D] holding, per (block, kv head), the keys
        as [D, bs] then the values as [bs, D] (:func:`paged_kv`).  Seen as rows of ``bs`` elements,
        the keys of (block, head, d) are one row and the values of (block, head) are D consecutive
        rows, so one ``index_select`` gathers every request's K^T [Hkv, D, L] and V [Hkv, L, D] for
        L = its blocks x bs positions.  vLLM has already written this step's K/V into their slots
        (CPU_ATTN updates the cache before ``forward``), so the in-flight keys are read from the
        cache too; the mask allows the committed prefix and, of the in-flight positions, the row's
        ancestors (its causal predecessors for a request without a tree).
        """
        if getattr(self, "_plan_md", None) is self._md:
            return self._plan
        nb, hkv, bs, d2 = kv_cache.shape
        D = d2 // 2
        B, W = self.qlens.shape[0], self.max_w
        seq = self._prefix + self.qlens                                         # [B] keys per request
        nblk = (int(seq.max()) + bs - 1) // bs                                  # CPU: no device to wait for
        L = nblk * bs
        blk = self._table[:, :nblk].long()                                      # [B, nblk]
        base = (blk[:, None] * hkv + torch.arange(hkv)[None, :, None]) * d2     # [B, Hkv, nblk] first row
        c = torch.arange(D)
        k_rows = base[:, :, None, :] + c[None, None, :, None]                   # [B, Hkv, D, nblk]
        v_rows = base[:, :, :, None] + D + c[None, None, None, :]               # [B, Hkv, nblk, D]
        rows = torch.stack([k_rows.reshape(-1), v_rows.reshape(-1)])
        qsl = self.qsl.long()
        i = torch.arange(W)
        valid = i[None] < self.qlens[:, None]                                   # [B, W]
        idx = torch.where(valid, qsl[:-1, None] + i[None], 0)
        tree = unpack_tree_bits(self.bits, W)[idx] & valid[:, :, None]          # [B, W, W]
        pos = torch.arange(L)[None] - self._prefix[:, None].long()              # [B, L] position - prefix
        flight = torch.gather(tree, 2, pos.clamp(0, W - 1)[:, None].expand(B, W, L))
        allow = (pos < 0)[:, None] | (flight & (pos < self.qlens[:, None])[:, None])
        allow[:, :, 0] |= ~valid                       # padding rows (dropped) see key 0: no NaN anywhere
        allow = allow[:, :, : int(seq.max())]                                   # keys past every request: none
        if W < SDPA_MIN_ROWS:  # an additive mask per (request, kv head), rows ordered (token, query head)
            G, n = heads // hkv, allow.shape[2]
            mask = torch.zeros(B, W, n).masked_fill_(~allow, float("-inf"))
            mask = mask[:, None, :, None].expand(B, hkv, W, G, n).reshape(B * hkv, W * G, n)
        else:
            mask = allow[:, None]                                               # [B, 1, W, keys] for SDPA
        self._plan = (rows.reshape(-1), mask, idx, valid, L)
        self._plan_md = self._md
        return self._plan

    def _dense(self, q, kv_cache, scale):
        """CPU, whole batch: a few ops per layer.  Small trees: gather, baddbmm, softmax, bmm (intermediates
        of [rows, keys] fit in cache; each op's fixed cost dominates).  From ``SDPA_MIN_ROWS`` rows per
        request: PyTorch's fused CPU attention, which tiles them (K made [keys, D]-contiguous first)."""
        rows, mask, idx, valid, L = self._cpu_plan(kv_cache, q.shape[1])
        nb, hkv, bs, d2 = kv_cache.shape
        B, W = idx.shape
        H, D = q.shape[1], q.shape[2]
        G, n = H // hkv, mask.shape[-1]
        kv = torch.index_select(kv_cache.reshape(-1, bs), 0, rows).view(2, B, hkv, -1).float()
        kt, v = kv[0].view(B, hkv, D, L)[..., :n], kv[1].view(B, hkv, L, D)[:, :, :n]
        qr = (q[: self.total] if B == 1 else q[idx]).view(B, W, hkv, G, D)
        if W < SDPA_MIN_ROWS:
            qg = qr.transpose(1, 2).reshape(B * hkv, W * G, D).float()
            p = torch.softmax(torch.baddbmm(mask, qg, kt.reshape(B * hkv, D, n), alpha=scale), -1)
            o = torch.bmm(p, v.reshape(B * hkv, n, D)).view(B, hkv, W, G, D).transpose(1, 2)  # [B, W, Hkv, G, D]
        else:
            o = torch.nn.functional.scaled_dot_product_attention(
                qr.view(B, W, H, D).transpose(1, 2).float(), kt.transpose(-1, -2).contiguous(), v, attn_mask=mask,
                scale=scale, enable_gqa=G > 1).transpose(1, 2)                 # [B, W, H, D]
        return o.reshape(W, H, D) if B == 1 else o.reshape(B, W, H, D)[valid]



# ---------------------------------------------------------------------------- runner hooks
@dataclass
class TreeStep:
    """What the sampler needs from ``_prepare_inputs`` of a tree step."""

    root_rows: np.ndarray       # [num_reqs] token row of each request's root (-1: no tree)
    widths: np.ndarray          # [num_reqs] tree nodes scheduled (0: no tree)
    slot_mapping: torch.Tensor  # [num_tokens] KV slot of every scheduled token (sequential)
    attention: "VerifyTreeAttention | None" = None  # the target forward's (taken by _model_forward)



def tree_state(runner) -> TreeState | None:
    """The tree state of the runner's Falcon proposer (None: not a Falcon tree runner)."""
    return getattr(getattr(runner, "drafter", None), "tree_state", None)


def _begin_tree_step(runner, state: TreeState, md, num_scheduled_tokens) -> TreeStep:
    widths = np.asarray(md.num_draft_tokens, dtype=np.int64)
    n_sched = np.asarray(num_scheduled_tokens[: len(widths)], dtype=np.int64)
    total = int(n_sched.sum())
    slot_mapping = runner.input_batch.block_table[0].slot_mapping.gpu[:total].clone()
    root_rows, attention = plan_tree_rows(state, widths, n_sched, runner.positions)
    return TreeStep(root_rows=root_rows, widths=widths, slot_mapping=slot_mapping, attention=attention)


def plan_tree_rows(state: TreeState, widths: np.ndarray, n_sched: np.ndarray, positions: torch.Tensor):
    """A tree step's rows, for any runner: each request's root row (-1: no tree; ``widths`` [B] its scheduled nodes,
    ``n_sched`` [B] its scheduled tokens, laid out request after request) and the target forward's attention
    (None without a tree).  The node tokens' ``positions`` (the forward's, [tokens]) are rewritten in place to
    root position + depth; their KV slots stay consecutive."""
    cu = np.cumsum(n_sched)
    root_rows = np.where(widths > 0, cu - widths - 1, -1)
    dev = positions.device
    trees = [int(i) for i in np.nonzero(widths)[0]]
    if not trees:
        return root_rows, None
    rows, roots, depth = [], [], []
    for r in trees:
        w = int(widths[r])
        rows.append(root_rows[r] + 1 + np.arange(w))
        roots.append(np.full(w, root_rows[r]))
        depth.append(state.drafted(w).depth[1:].numpy())
    rows_t, roots_t, depth_t = to_device([torch.from_numpy(np.concatenate(rows)),
                                          torch.from_numpy(np.concatenate(roots)),
                                          torch.from_numpy(np.concatenate(depth))], dev)
    positions[rows_t] = positions[roots_t] + depth_t.to(positions.dtype)
    # the attention context of this forward: every request when the others are short causal queries
    # (the tree path then serves the whole batch), else the tree requests only, root first
    whole = all(widths[r] > 0 or n_sched[r] <= MAX_CAUSAL_ROWS for r in range(len(widths)))
    reqs = list(range(len(widths))) if whole else trees
    qlens = np.where(widths[reqs] > 0, widths[reqs] + 1, n_sched[reqs])
    qsl = np.concatenate([[0], np.cumsum(qlens)])
    words = (int(qlens.max()) + 31) // 32
    bits = torch.cat([state.subtrees.bits(state.drafted_k, int(widths[r]), words) if widths[r] > 0
                      else state.subtrees.causal_bits(int(n_sched[r]), words) for r in reqs])
    all_rows = None if whole else np.concatenate([root_rows[r] + np.arange(widths[r] + 1) for r in trees])
    return root_rows, VerifyTreeAttention(all_rows, trees, qsl, bits, dev, whole)


# vLLM's built-in logits processors; each one is tied to a request field checked in tree_drafts_for
_BUILTIN_PROCS = ("MinPLogitsProcessor", "LogitBiasLogitsProcessor", "MinTokensLogitsProcessor")


def _custom_logitsprocs(runner) -> bool:
    procs = runner.input_batch.sampling_metadata.logitsprocs.all
    return any(type(p).__name__ not in _BUILTIN_PROCS for p in (procs() if callable(procs) else procs))


def tree_drafts_for(sp) -> bool:
    """Whether the tree sampler computes exactly what vLLM's sampler would for a request with these
    sampling params: temperature, top-k and top-p only.  Any other feature (penalties, min_p, min_tokens,
    logit_bias, allowed / bad words, structured output, thinking budget) turns drafting off for that
    request: it is sampled by vLLM's own sampler, one token per step, while the batch keeps its trees.
    So does a seed at temperature > 0: the tree it would verify (its width follows the batch size) and so its
    draws from its generator would depend on its batch-mates; sampled plainly, it draws as vanilla vLLM does."""
    return sp is not None and not (
        sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0 or sp.min_p or sp.min_tokens
        or sp.logit_bias or sp.allowed_token_ids or sp.bad_words or sp.structured_outputs is not None
        or getattr(sp, "thinking_token_budget", None) is not None
        or (getattr(sp, "seed", None) is not None and sp.temperature >= SAMPLING_EPS))


def _plain_requests(runner, widths) -> list[int]:
    """Rows of the batch sampled by vLLM's own sampler this step (no tree, or drafting off)."""
    custom = _custom_logitsprocs(runner)  # engine-wide processors may touch any request
    reqs = runner.input_batch.req_ids
    return [r for r in range(len(widths)) if widths[r] == 0 or custom
            or not tree_drafts_for(getattr(runner.requests.get(reqs[r]), "sampling_params", None))]


# fp32 logits a sampling chunk copies at most (64 MiB; top-k/top-p processing adds a few buffers of the same
# size): the tree sampler's memory stays bounded whatever the batch, tree and vocabulary, so vLLM's
# profiling run (which never sees a tree step) does not have to reserve it.  A chunk's walk reads one row per
# request and depth, so a chunk holds SAMPLER_MAX_ELEMS // V requests (128 at a 128k vocabulary).
SAMPLER_MAX_ELEMS = 1 << 24


def verify_requests(tree: DecodingTree | None, nodes, logits: torch.Tensor, starts: torch.Tensor, temperature=None,
                    top_k=None, top_p=None, generator=None, argmax: torch.Tensor | None = None,
                    max_elems: int | None = None):
    """Verify G requests with the same tree whose ``1 + w`` logits rows start at ``starts`` [G] of ``logits``
    [T, V] (``tree`` None: w = 0, plain sampling of one token).  Returns (tokens [G, 1 + w] int64, -1
    padded; accepted slots per request).

    Greedy (``temperature`` None) reads only ``argmax`` [T] (computed once per step).  Sampling walks
    chunks of requests whose rows of one depth hold at most ``max_elems`` fp32 logits (the walk reads the
    rows it needs from ``logits`` in place: ``sample_verify(slot_rows=...)``).
    """
    G, dev = starts.shape[0], logits.device
    w = 0 if tree is None else tree.num_nodes
    rows = starts[:, None] + torch.arange(w + 1, device=dev)                     # [G, 1+w]
    if temperature is None:
        am = (logits.argmax(-1) if argmax is None else argmax)[rows]
        if tree is None:
            return am, [[] for _ in range(G)]
        res = greedy_verify_argmax(tree, nodes, am)
        return res.output_token_ids(nodes, width=w + 1).to(dev), res.accepted_slots
    V = logits.shape[-1]
    budget = SAMPLER_MAX_ELEMS if max_elems is None else max_elems
    chunk = max(1, budget // V)
    toks, accepted = [], []
    for c in range(0, G, chunk):
        sl = slice(c, c + chunk)
        pick = lambda x: None if x is None else x[sl]  # noqa: E731
        t, tk, tp = pick(temperature), pick(top_k), pick(top_p)
        if tree is None:
            p = probs_from_logits(logits[rows[sl, 0]], t, tk, tp)
            toks.append(sample_tokens(p, generator)[:, None])
            accepted += [[] for _ in range(p.shape[0])]
            continue
        res = sample_verify(tree, nodes[sl], logits, t, tk, tp, generator=generator, slot_rows=rows[sl])
        toks.append(res.output_token_ids(nodes[sl], width=w + 1).to(dev))
        accepted += res.accepted_slots
    return torch.cat(toks), accepted


def tree_sample(runner, state: TreeState, step: TreeStep, logits: torch.Tensor, md):
    """Verify each request's tree, compact the accepted path, return vLLM's ``SamplerOutput``."""
    from vllm.v1.outputs import SamplerOutput

    sm = runner.input_batch.sampling_metadata
    widths = step.widths
    B = len(widths)
    dev = logits.device
    cu_s = np.cumsum(widths + 1)
    cu_d = np.cumsum(widths)
    out = torch.full((B, int(widths.max()) + 1), -1, dtype=torch.int32, device=dev)
    draft = md.draft_token_ids.long()
    plain = _plain_requests(runner, widths)
    if plain:  # vLLM's own sampler on every request's root row, exactly a non-speculative step
        roots = torch.from_numpy(cu_s - widths - 1).to(dev)
        idx = torch.tensor(plain, dtype=torch.long, device=dev)
        # it draws from every seeded request's generator: the tree requests' draws are given back
        saved = {i: g.get_state() for i, g in (sm.generators or {}).items() if i not in plain}
        # with logprobs: every root row's, in the runner's logprobs_mode, as vanilla's sampler gives them
        res = runner.sampler(logits[roots], sm if sm.max_num_logprobs is None else
                             dataclasses.replace(sm, max_num_logprobs=-1))
        out[idx, 0] = res.sampled_token_ids[idx, 0].to(torch.int32)
        lp_tensors = getattr(res, "logprobs_tensors", None) if sm.max_num_logprobs is not None else None
        plain_lp = None if lp_tensors is None else lp_tensors.logprobs[idx]
        for i, st in saved.items():
            sm.generators[i].set_state(st)
    else:
        plain_lp = None
    temp = None if sm.all_greedy or sm.temperature is None else sm.temperature
    gens = sm.generators or {}
    paths: dict[int, list[int]] = {}
    groups: dict[tuple, list[int]] = {}
    for r in sorted(set(range(B)) - set(plain)):
        groups.setdefault((int(widths[r]), r if r in gens else -1), []).append(r)
    argmax = logits.argmax(-1) if temp is None and groups else None  # greedy: one pass over the logits
    for (w, seeded), reqs in groups.items():
        idx = torch.tensor(reqs, dtype=torch.long, device=dev)
        starts = torch.from_numpy(cu_s[reqs] - w - 1).to(dev)
        t = None if temp is None else temp[idx]
        tk = None if sm.top_k is None else sm.top_k[idx]
        tp = None if sm.top_p is None else sm.top_p[idx]
        dstart = torch.from_numpy(cu_d[reqs] - w).to(dev)              # plain requests (w = 0) are done above
        nodes = draft[dstart[:, None] + torch.arange(w, device=dev)]                # [G, w]
        sub = state.drafted(w)
        toks, accepted = verify_requests(sub, nodes, logits, starts, t, tk, tp, gens.get(seeded), argmax)
        out[idx, : w + 1] = toks.to(torch.int32)
        for i, r in enumerate(reqs):
            if accepted[i]:
                paths[r] = accepted[i]
    logprobs = None
    if sm.max_num_logprobs is not None:
        logprobs = _logprobs(runner, sm, logits, out, cu_s - widths - 1, paths, plain, plain_lp)
    if paths:
        compact(runner, state, step, paths)
    state.record(widths, paths)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)


def _logprobs(runner, sm, logits, out, starts, paths, plain, plain_lp):
    """Target logprobs of every emitted token (and the top ``sm.max_num_logprobs``), in vLLM's layout and in the
    runner's ``logprobs_mode``, as vLLM's sampler computes them.

    Output column j of a request was predicted at the slot before it on the accepted path (the
    root for j = 0), so its logits row is that slot's.  Raw modes read the target's logits; processed modes read
    them after the request's temperature, top-k and top-p (a greedy request: temperature 1), which are all the
    processing a tree request has (``tree_drafts_for``).  A plain request's row (``plain``) is the one vLLM's
    sampler returned for it (``plain_lp``), its logits processors applied.
    """
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    B, width = out.shape
    rows = np.repeat(np.asarray(starts, dtype=np.int64)[:, None], width, 1)
    for r, path in paths.items():
        rows[r, 1: len(path) + 1] += np.asarray(path)
    lg = logits[torch.from_numpy(rows.reshape(-1)).to(logits.device)].float()
    mode = getattr(runner.sampler, "logprobs_mode", "raw_logprobs")
    if mode.startswith("processed"):
        per_row = lambda x: None if x is None else x.repeat_interleave(width)  # noqa: E731
        if sm.temperature is not None:
            lg = lg.div_(per_row(torch.where(sm.temperature < SAMPLING_EPS, 1.0, sm.temperature)).unsqueeze(1))
        lg = apply_top_k_top_p(lg, per_row(sm.top_k), per_row(sm.top_p))
    lp = lg if mode.endswith("logits") else runner.sampler.compute_logprobs(lg)
    if plain and plain_lp is not None:
        lp = lp.view(B, width, -1)
        lp[torch.tensor(plain, device=lp.device), 0] = plain_lp.to(lp.dtype)
        lp = lp.view(B * width, -1)
    return runner.sampler.gather_logprobs(lp, sm.max_num_logprobs, out.reshape(-1).clamp(min=0).long())


# ---------------------------------------------------------------------------- runner hooks
def _prepare_inputs(orig):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        res = orig(self, scheduler_output, num_scheduled_tokens)
        state = tree_state(self)
        if state is not None:
            md = res[1]
            state.step = (_begin_tree_step(self, state, md, num_scheduled_tokens)
                          if md is not None and any(md.num_draft_tokens) else None)
        return res

    return _prepare_inputs


def _model_forward(orig):
    def _model_forward(self, *args, **kwargs):
        state = tree_state(self)
        step = None if state is None else state.step
        if step is None or step.attention is None:
            return orig(self, *args, **kwargs)
        attention, step.attention = step.attention, None  # one target forward per step uses it
        with tree_attention_scope(attention):
            return orig(self, *args, **kwargs)

    return _model_forward


def _sample_tokens(orig):
    def sample_tokens(self, grammar_output):
        state = tree_state(self)
        if state is None:
            return orig(self, grammar_output)
        ems = self.execute_model_state  # the target hidden states of this step (the compaction reorders them)
        state.hidden_states = ems.hidden_states if ems is not None else None
        try:
            return orig(self, grammar_output)
        finally:
            state.hidden_states = None

    return sample_tokens


def _sample(orig):
    def _sample(self, logits, spec_decode_metadata):
        state = tree_state(self)
        step = None if state is None else state.step
        if step is None or spec_decode_metadata is None:
            if (spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens)
                    and falcon_proposer(self) is not None):
                # no-drafts fast path, verify side: vLLM builds spec-decode metadata for every step of a
                # speculative engine, even one that verifies nothing (a schedule that turns drafting off);
                # such a step samples with vLLM's plain sampler, exactly as a vanilla step does (one logits
                # row per request either way), instead of the rejection or tree sampler on empty drafts
                spec_decode_metadata = None
            return orig(self, logits, spec_decode_metadata)
        state.step = None
        self.input_batch.update_async_output_token_ids()
        return tree_sample(self, state, step, logits, spec_decode_metadata)

    return _sample


def _take_draft_token_ids(orig):
    def take_draft_token_ids(self):
        out = orig(self)
        drafter = falcon_proposer(self)
        if drafter is not None and not drafter.take_proposed():
            # vLLM ran no drafter this step (a request of the batch is within K tokens of max_model_len) and hands
            # the scheduler K zero tokens per request: schedule none instead.  A tree would pair its width with the
            # previous step's smaller subtree; a chain would verify K tokens that cannot be accepted.  The step's
            # verified rows reach no drafter pass: those requests' drafter K/V has a gap.
            if drafter.lookup is not None:
                drafter.lookup.skipped(list(self.input_batch.req_ids), self.requests)
                drafter.note_drops()
            if out is not None:
                out.draft_token_ids = [[] for _ in out.req_ids]
            return out
        if out is not None and getattr(self.input_batch, "logprob_token_ids", None):
            # a request asks for the logprobs of given token ids: only vLLM's plain sampler returns them (its
            # rejection sampler and the tree sampler do not), so the step after this one verifies no drafts
            out.draft_token_ids = [[] for _ in out.req_ids]
            return out
        if out is not None and tree_state(self) is not None:
            # requests the tree sampler cannot serve exactly get no speculative tokens scheduled
            custom = _custom_logitsprocs(self)
            out.draft_token_ids = [t if not custom and tree_drafts_for(
                getattr(self.requests.get(rid), "sampling_params", None)) else []
                for rid, t in zip(out.req_ids, out.draft_token_ids)]
        return out

    return take_draft_token_ids


def install() -> None:
    """Wrap the V1 runner's methods tree mode hooks (idempotent; see :mod:`falcon_vllm.vllm.patches`)."""
    runner = patches.resolve("vllm.v1.worker.gpu_model_runner:GPUModelRunner")
    for name, make in (("_prepare_inputs", _prepare_inputs), ("_model_forward", _model_forward),
                       ("sample_tokens", _sample_tokens), ("_sample", _sample),
                       ("take_draft_token_ids", _take_draft_token_ids)):
        patches.wrap(runner, name, make)
