"""Tree mode inside vLLM's V1 model runner: the decoding tree verified in one target pass.

A step of tree mode looks like this (the proposer side is in :mod:`falcon_vllm.vllm.proposer`):

1. The Falcon proposer drafts the tree's N node tokens per request; vLLM schedules them as the
   request's N speculative tokens, so the target runs ``[root] + nodes`` (1 + N tokens, written to
   consecutive KV slots as for a chain).
2. ``_prepare_inputs`` (wrapped): the positions of the node tokens are rewritten to
   ``root position + depth``, and the tree-attention context is armed for this forward.
3. Target attention (the backend's ``forward``, wrapped): every token's attention is computed once.
   When the batch holds only trees and short queries, the tree path serves every row (tree requests
   over the paged prefix plus their in-flight tokens under the ancestor mask, the others causally)
   and the stock kernel is skipped (CUDA: the Triton kernel of ``kernels/tree_attention.py``; CPU: one
   batched masked SDPA per layer).  A batch with a prefill chunk runs the stock kernel and recomputes
   the tree requests' rows only.
4. ``_sample`` (wrapped): the tree sampler (greedy or lossless recursive rejection sampling from
   :mod:`falcon_vllm.verify`) replaces vLLM's chain rejection sampler.  It emits the accepted
   path's tokens + the bonus token in vLLM's output format.
5. Compaction: the accepted nodes' target K/V are copied into the slots right after the root, and
   the runner's per-token buffers (input ids, positions, target hidden states) are reordered the
   same way.  From here on the step is indistinguishable from a chain step that accepted ``a``
   tokens: vLLM's rollback (``num_computed -= N - a``), prefix caching, metrics and the drafter's
   next chunk pass (which rewrites the drafter's K/V for the accepted positions) all stay correct.

The drafter's SAR tree passes attend to the drafter's paged prefix, their ancestor blocks and
themselves, in one batched attention call per layer and pass; their K/V live only for the step
(:class:`DraftTreeAttention`), never in the paged cache.  Compaction on CUDA is one launch of
``kernels/kv_compaction.py`` for all layers; the tree sampler copies logits in bounded chunks.

All hooks check ``runner.drafter.tree``; runners without a Falcon tree are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.logger import init_logger

from falcon_vllm.kernels.tree_attention import (causal_tree_bits, pack_tree_mask, tree_attention_ref,
                                                unpack_tree_bits)
from falcon_vllm.tree import DecodingTree
from falcon_vllm.verify import greedy_verify_argmax, probs_from_logits, sample_verify

logger = init_logger(__name__)


# ---------------------------------------------------------------------------- paged KV layouts
def kv_layout(impl, layer=None) -> str:
    """The paged layout of a layer's KV cache: ``cpu`` (CPU_ATTN, vec ISAs) or ``flash`` (NHD)."""
    name = type(impl).__name__
    if name.startswith("CPUAttention"):
        isa = getattr(layer, "isa", "vec")
        if isa not in ("vec", "vec16"):
            raise NotImplementedError(f"falcon tree mode: the CPU attention ISA {isa!r} packs its KV cache in a "
                                      "layout tree mode cannot read (supported: vec, vec16; use float32/float16)")
        return "cpu"
    if name.startswith("FlashAttention"):
        return "flash"
    raise NotImplementedError(f"falcon tree mode: attention backend {name} is not supported "
                              "(supported: CPU_ATTN on CPU, FLASH_ATTN on CUDA)")


def _unsupported(name: str, layer) -> str | None:
    """What tree attention cannot compute exactly for this attention layer (None: supported)."""
    impl = layer.impl
    sw, cap = getattr(impl, "sliding_window", None), getattr(impl, "logits_soft_cap", None)
    checks = (
        (sw not in (None, -1, (-1, -1)), f"sliding-window attention (window {sw})"),
        (cap not in (None, 0), f"attention logit soft-capping ({cap})"),
        (getattr(impl, "alibi_slopes", None) is not None, "ALiBi position biases"),
        (getattr(impl, "sinks", None) is not None, "attention sinks"),
        (getattr(impl, "kv_cache_dtype", "auto") != "auto", f"a {getattr(impl, 'kv_cache_dtype', '')} KV cache "
         "(kv_cache_dtype; tree mode reads unscaled K/V)"),
        (getattr(impl, "kv_sharing_target_layer_name", None) is not None, "cross-layer KV-cache sharing"),
        (str(getattr(getattr(impl, "attn_type", "decoder"), "value", getattr(impl, "attn_type", "decoder")))
         != "decoder", f"{getattr(impl, 'attn_type', '')} attention"),
    )
    for bad, what in checks:
        if bad:
            return what
    try:
        kv_layout(impl, layer)
    except NotImplementedError as e:
        return str(e).removeprefix("falcon tree mode: ")
    d = getattr(impl, "head_size", None)
    if type(impl).__name__.startswith("FlashAttention") and d is not None and (d & (d - 1) or not 16 <= d <= 256):
        return f"head size {d} (the Triton tree-attention kernel takes powers of two in [16, 256])"
    return None


def check_startup(vllm_config, kv_cache_config, draft_layer_names) -> None:
    """Refuse, before serving, any model or setting tree mode cannot serve exactly (one error naming it).

    Called once the KV cache and the attention backends exist (the proposer's
    ``initialize_attn_backend``).  Chain mode (vLLM's own EAGLE path) has none of these limits.
    """
    draft = set(draft_layer_names or ())
    ctx = vllm_config.compilation_config.static_forward_context
    hint = ("; tree mode refuses it at start-up rather than return something other than vanilla vLLM would. "
            "Serve this model in chain mode (a chain tree such as \"chain-4\", or no \"tree\" key)")
    for name, layer in ctx.items():
        if getattr(layer, "impl", None) is None or not hasattr(layer, "kv_cache"):
            continue
        what = _unsupported(name, layer)
        if what is not None:
            raise ValueError(f"falcon-vllm: tree mode does not support {what} (layer {name}){hint}")
    gid = {n: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for n in group.layer_names}
    target = {gid[n] for n in gid if n not in draft}
    if target != {0}:
        raise ValueError(f"falcon-vllm: tree mode does not support a target whose KV cache spans several KV-cache "
                         f"groups ({len(kv_cache_config.kv_cache_groups)} groups: hybrid or multi-spec models; "
                         f"target layers in groups {sorted(target)}){hint}")


def paged_kv(kv_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's KV cache -> (key_cache, value_cache) as [num_blocks, block_size, Hkv, D] views.

    vLLM 0.32 gives every attention layer the logical view [num_blocks, Hkv, block_size, 2 * D]
    (``create_kv_cache_views``) with the strides of the resolved ``KVCacheLayout``.
    """
    if layout == "flash":
        # FLASH_ATTN: any stride order; K and V are read exactly as FlashAttentionImpl.forward does
        return tuple(kv_cache.transpose(1, 2).split(kv_cache.shape[-1] // 2, dim=-1))
    if layout == "cpu":
        # CPU_ATTN (vec ISAs): per (block, kv head) bs*D key values stored [D, bs] (transposed),
        # then bs*D values stored [bs, D]
        nb, hkv, bs, d2 = kv_cache.shape
        d = d2 // 2
        flat = kv_cache.view(nb, hkv, bs * d2)
        keys = flat[:, :, : bs * d].unflatten(2, (d, bs)).permute(0, 3, 1, 2)
        vals = flat[:, :, bs * d:].unflatten(2, (bs, d)).permute(0, 2, 1, 3)
        return keys, vals
    raise ValueError(f"falcon tree mode: unknown KV layout {layout!r}")


def copy_kv_slots(kv_cache: torch.Tensor, layout: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V of flat slots ``src`` into slots ``dst`` (all heads) of one layer's cache."""
    kc, vc = paged_kv(kv_cache, layout)
    bs = kc.shape[1]
    sb, so, db, do = src // bs, src % bs, dst // bs, dst % bs
    for c in (kc, vc):
        c[db, do] = c[sb, so]  # the right side is gathered before the write


def _attn_fn(q: torch.Tensor):
    if q.is_cuda:
        try:
            from falcon_vllm.kernels.tree_attention import tree_attention
            return tree_attention
        except ImportError:  # triton missing: the torch path is still exact
            pass
    return tree_attention_ref


# ---------------------------------------------------------------------------- attention contexts
# A request without a tree whose query is at most this long (a decode row, a short chunk) is served by the
# tree-attention path with a causal mask, so the stock kernel can be skipped for the whole batch; a batch
# holding a longer query (a prefill chunk) runs the stock kernel and recomputes only the tree rows.
MAX_CAUSAL_ROWS = 64


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
        self.rows = (slice(0, self.total) if whole
                     else torch.as_tensor(rows, dtype=torch.long, device=device))  # token rows (root first)
        self.req_idx = (slice(0, len(qsl) - 1) if whole
                        else torch.as_tensor(req_idx, dtype=torch.long, device=device))  # request of each tree
        self.qlens = torch.as_tensor(np.diff(qsl), dtype=torch.int32, device=device)
        self.qsl = torch.as_tensor(qsl, dtype=torch.int32, device=device)
        self.bits = bits.to(device)
        self.max_w = int(np.diff(qsl).max())
        self._md = None  # the metadata the cached prefix lengths / block table belong to
        self._prefix = self._table = None

    def attend(self, impl, layer, q, k, v, kv_cache, md, output):
        kc, vc = paged_kv(kv_cache, kv_layout(impl, layer))
        H, D = q.shape[1], q.shape[2]
        if self._md is not md:  # once per KV-cache group and forward, not per layer
            self._md = md
            self._prefix = (md.seq_lens[self.req_idx] - self.qlens).to(torch.int32)
            self._table = md.block_table[self.req_idx]
        out = output.view(-1, H, D)
        if self.whole:
            n = self.total
            if not q.is_cuda:  # CPU: one batched call per layer (padded requests) instead of a loop over them
                out[:n] = self._dense(q, k, v, kc, vc, impl.scale).to(out.dtype)
                return
            _attn_fn(q)(q[:n], k[:n], v[:n], kc, vc, self._table, self._prefix, self.qsl, self.bits, impl.scale,
                        out=out[:n], max_query_len=self.max_w, max_prefix_len=int(md.max_seq_len))
            return
        res = _attn_fn(q)(q[self.rows], k[self.rows], v[self.rows], kc, vc, self._table, self._prefix, self.qsl,
                          self.bits, impl.scale, max_query_len=self.max_w, max_prefix_len=int(md.max_seq_len))
        out[self.rows] = res.to(output.dtype)

    def _dense_plan(self, bs: int):
        """Per forward: padded row index [B, Wmax], valid rows, and the mask [B, Wmax, P + Wmax]."""
        if getattr(self, "_plan_md", None) is self._md:
            return self._plan
        qsl = self.qsl.long()
        B, W = self.qlens.shape[0], self.max_w
        P = max(int(self._prefix.max()), 1)                                     # CPU: no device to wait for
        i = torch.arange(W)
        valid = i[None] < self.qlens[:, None]                                   # [B, W]
        idx = torch.where(valid, qsl[:-1, None] + i[None], 0)
        inflight = unpack_tree_bits(self.bits, W)[idx] & valid[:, :, None]     # [B, W, W]
        inflight |= torch.eye(W, dtype=torch.bool)[None] & ~valid[:, :, None]  # padding rows see themselves
        prefix = (torch.arange(P)[None] < self._prefix[:, None])[:, None].expand(B, W, P)
        nblk = (P + bs - 1) // bs
        self._plan = (idx, valid, torch.cat([prefix, inflight], 2), P, self._table[:, :nblk].long())
        self._plan_md = self._md
        return self._plan

    def _dense(self, q, k, v, kc, vc, scale):
        idx, valid, mask, P, blocks = self._dense_plan(kc.shape[1])
        B, W = idx.shape
        hkv, D = kc.shape[2], kc.shape[3]
        pk = kc[blocks].reshape(B, -1, hkv, D)[:, :P]
        pv = vc[blocks].reshape(B, -1, hkv, D)[:, :P]
        o = dense_attention(q[idx], torch.cat([pk, k[idx]], 1), torch.cat([pv, v[idx]], 1), mask, scale)
        return o[valid]                                                         # [T, H, D], request order


def dense_attention(q, keys, values, mask, scale):
    """One batched attention call: q [B, Q, H, D], keys/values [B, L, Hkv, D], mask [B or 1, Q, L] bool."""
    H, hkv = q.shape[2], keys.shape[2]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), keys.float().transpose(1, 2), values.float().transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=H != hkv)
    return o.transpose(1, 2)                                                   # [B, Q, H, D]


class DraftTreeAttention:
    """The drafter's SAR tree passes of one step, batched: one attention call per layer and pass.

    Block j of request r in pass t sees the drafter's paged prefix of r (``prefix_lens[r]``
    positions), the K/V of its ancestor blocks from the earlier tree passes of this step (kept
    here, never written to the paged cache), and its own k tokens (non-causal).  Every request's
    prefix is gathered once per layer and step into a padded [B, P_max] tensor; the keys of a pass
    are [prefix | all blocks of the earlier passes | this pass's blocks] with one boolean mask
    (prefix length per request, ancestor blocks and own block per query row) shared by all layers.
    """

    def __init__(self, block_table: torch.Tensor, prefix_lens: torch.Tensor, k: int,
                 max_prefix: int | None = None):
        self.block_table = block_table
        self.prefix_lens = prefix_lens
        self.B, self.k = block_table.shape[0], k
        # the padded prefix length: exact on CPU (no device to wait for), a host-side bound on GPU
        if max_prefix is None or not prefix_lens.is_cuda:
            max_prefix = int(prefix_lens.max()) if self.B else 0
        self.P = max(int(max_prefix), 1)
        self.store: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.nb = 0
        self.mask: torch.Tensor | None = None   # [B, nb * k, P + keys of earlier passes + nb * k]
        self._sizes: list[int] = []             # blocks of each pass begun so far
        self._prefix: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pmask = (torch.arange(self.P, device=prefix_lens.device)[None] < prefix_lens[:, None])[:, None]

    def begin_pass(self, chain: torch.Tensor) -> None:
        """chain [nb, passes so far]: the ancestor block of each block in every earlier pass."""
        nb, t = chain.shape
        k = self.k
        sizes = self._sizes
        if len(sizes) != t:
            raise ValueError(f"begin_pass: {t} earlier passes in the chain, {len(sizes)} passes run")
        self._sizes = sizes + [nb]
        self.nb = nb
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64) * k
        hist = int(offs[-1])
        own = torch.zeros(nb * k, hist + nb * k, dtype=torch.bool)
        rows = torch.arange(nb * k)
        blk = rows // k
        ch = chain.cpu().long()
        for s in range(t):                       # ancestor block of pass s: its k keys
            cols = int(offs[s]) + ch[blk, s][:, None] * k + torch.arange(k)[None]
            own[rows[:, None], cols] = True
        own[rows[:, None], hist + blk[:, None] * k + torch.arange(k)[None]] = True   # own block, non-causal
        dev = self.prefix_lens.device
        self.mask = torch.cat([self._pmask.expand(self.B, nb * k, self.P),
                               own.to(dev)[None].expand(self.B, -1, -1)], dim=2)

    def _padded_prefix(self, name, kc, vc):
        if name not in self._prefix:
            bs = kc.shape[1]
            nblk = (self.P + bs - 1) // bs
            blocks = self.block_table[:, :nblk].long()                              # [B, nblk]
            hkv, D = kc.shape[2], kc.shape[3]
            pk = kc[blocks].reshape(self.B, nblk * bs, hkv, D)[:, : self.P]
            pv = vc[blocks].reshape(self.B, nblk * bs, hkv, D)[:, : self.P]
            self._prefix[name] = (pk, pv)
        return self._prefix[name]

    def attend(self, impl, layer, q, key, value, kv_cache, output):
        name = layer.layer_name
        B, nb, k = self.B, self.nb, self.k
        n = B * nb * k
        H, D, hkv = q.shape[1], q.shape[2], key.shape[1]
        own_k = key[:n].reshape(B, nb * k, hkv, D)
        own_v = value[:n].reshape(B, nb * k, hkv, D)
        hist = self.store.setdefault(name, [])
        kc, vc = paged_kv(kv_cache, kv_layout(impl, layer))
        pk, pv = self._padded_prefix(name, kc, vc)
        keys = torch.cat([pk] + [h[0] for h in hist] + [own_k], dim=1)
        vals = torch.cat([pv] + [h[1] for h in hist] + [own_v], dim=1)
        o = dense_attention(q[:n].reshape(B, nb * k, H, D), keys, vals, self.mask, impl.scale)
        out = output.view(-1, H, D)
        out[:n] = o.reshape(n, H, D).to(out.dtype)
        hist.append((own_k.clone(), own_v.clone()))
        return output


class _Ctx:
    verify: VerifyTreeAttention | None = None
    draft: DraftTreeAttention | None = None


CTX = _Ctx()


def _wrap_attention_impl(cls) -> None:
    orig = cls.forward
    if getattr(orig, "_falcon", False):
        return

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, *args, **kwargs):
        if CTX.draft is not None:
            return CTX.draft.attend(self, layer, query, key, value, kv_cache, output)
        verify = CTX.verify if attn_metadata is not None else None
        if verify is not None and verify.whole:  # the tree path serves every row: the stock kernel is skipped
            verify.attend(self, layer, query, key, value, kv_cache, attn_metadata, output)
            return output
        result = orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if verify is not None:
            verify.attend(self, layer, query, key, value, kv_cache, attn_metadata, output)
        return result

    forward._falcon = True
    cls.forward = forward


# ---------------------------------------------------------------------------- runner hooks
@dataclass
class TreeStep:
    """What the sampler needs from ``_prepare_inputs`` of a tree step."""

    root_rows: np.ndarray       # [num_reqs] token row of each request's root (-1: no tree)
    widths: np.ndarray          # [num_reqs] tree nodes scheduled (0: no tree)
    slot_mapping: torch.Tensor  # [num_tokens] KV slot of every scheduled token (sequential)


class SubtreeCache:
    """The trees a step may draft: the full tree, or a W-node subtree when vLLM's dynamic
    speculation (``num_speculative_tokens_per_batch_size``) asks for W tokens at this batch size.

    ``sized`` maps W to the subtree fitted for it by ``falcon-vllm tune-tree``; other sizes take the
    first W nodes in slot order.  ``prefix(K, w)`` is the tree of a request whose K drafted nodes
    were cut to w by the scheduler (slot order puts parents first, so any prefix is a tree).
    """

    def __init__(self, tree: DecodingTree, sized: dict | None = None):
        self.tree = tree
        self._sub: dict[int, DecodingTree] = {}
        for w, paths in (sized or {}).items():
            self._sub[int(w)] = DecodingTree(paths, tree.k, f"{tree.name}[{int(w)}]")
        self._prefix: dict[tuple[int, int], DecodingTree] = {}
        self._bits: dict[tuple[int, int, int], torch.Tensor] = {}

    def get(self, w: int) -> DecodingTree:
        if w >= self.tree.num_nodes:
            return self.tree
        if w not in self._sub:
            self._sub[w] = DecodingTree(self.tree.to_list()[:w], self.tree.k, f"{self.tree.name}[:{w}]")
        return self._sub[w]

    def prefix(self, K: int, w: int) -> DecodingTree:
        full = self.get(K)
        if w >= full.num_nodes:
            return full
        if (K, w) not in self._prefix:
            self._prefix[(K, w)] = DecodingTree(full.to_list()[:w], full.k, f"{full.name}[:{w}]")
        return self._prefix[(K, w)]

    def causal_bits(self, width: int, words: int) -> torch.Tensor:
        key = (-1, width, words)
        if key not in self._bits:
            self._bits[key] = causal_tree_bits(width, words)
        return self._bits[key]

    def bits(self, K: int, w: int, words: int) -> torch.Tensor:
        key = (K, w, words)
        if key not in self._bits:
            self._bits[key] = pack_tree_mask(self.prefix(K, w).ancestor_mask, words)
        return self._bits[key]


def _tree_drafter(runner):
    d = getattr(runner, "drafter", None)
    return d if getattr(d, "tree", None) is not None else None


def _begin_tree_step(runner, drafter, md, num_scheduled_tokens) -> TreeStep:
    widths = np.asarray(md.num_draft_tokens, dtype=np.int64)
    n_sched = np.asarray(num_scheduled_tokens[: len(widths)], dtype=np.int64)
    cu = np.cumsum(n_sched)
    root_rows = np.where(widths > 0, cu - widths - 1, -1)
    total = int(cu[-1])
    dev = runner.positions.device
    trees = [int(i) for i in np.nonzero(widths)[0]]
    slot_mapping = runner.input_batch.block_table[0].slot_mapping.gpu[:total].clone()
    if trees:
        # positions of node tokens: root position + depth (their KV slots stay consecutive)
        rows, roots, depth = [], [], []
        for r in trees:
            w = int(widths[r])
            rows.append(root_rows[r] + 1 + np.arange(w))
            roots.append(np.full(w, root_rows[r]))
            depth.append(drafter.subtrees.prefix(drafter.drafted_k, w).depth[1:].numpy())
        rows_t = torch.from_numpy(np.concatenate(rows)).to(dev)
        roots_t = torch.from_numpy(np.concatenate(roots)).to(dev)
        runner.positions[rows_t] = runner.positions[roots_t] + torch.from_numpy(np.concatenate(depth)).to(
            dev, runner.positions.dtype)
        # the attention context of this forward: every request when the others are short causal queries
        # (the tree path then serves the whole batch), else the tree requests only, root first
        whole = all(widths[r] > 0 or n_sched[r] <= MAX_CAUSAL_ROWS for r in range(len(widths)))
        reqs = list(range(len(widths))) if whole else trees
        qlens = np.where(widths[reqs] > 0, widths[reqs] + 1, n_sched[reqs])
        qsl = np.concatenate([[0], np.cumsum(qlens)])
        words = (int(qlens.max()) + 31) // 32
        bits = torch.cat([drafter.subtrees.bits(drafter.drafted_k, int(widths[r]), words) if widths[r] > 0
                          else drafter.subtrees.causal_bits(int(n_sched[r]), words) for r in reqs])
        all_rows = None if whole else np.concatenate([root_rows[r] + np.arange(widths[r] + 1) for r in trees])
        CTX.verify = VerifyTreeAttention(all_rows, trees, qsl, bits, dev, whole)
    return TreeStep(root_rows=root_rows, widths=widths, slot_mapping=slot_mapping)


def _target_kv_caches(runner, drafter) -> list[tuple[torch.Tensor, str]]:
    ctx = runner.vllm_config.compilation_config.static_forward_context
    draft = set(getattr(drafter, "_draft_attn_layer_names", ()) or ())
    out = []
    for name, layer in ctx.items():
        if name in draft or not hasattr(layer, "kv_cache") or not hasattr(layer, "impl"):
            continue
        kv = layer.kv_cache
        if isinstance(kv, (list, tuple)):
            kv = kv[0]
        if isinstance(kv, torch.Tensor) and kv.numel():
            out.append((kv, kv_layout(layer.impl, layer)))
    return out


# vLLM's built-in logits processors; each one is tied to a request field checked in tree_drafts_for
_BUILTIN_PROCS = ("MinPLogitsProcessor", "LogitBiasLogitsProcessor", "MinTokensLogitsProcessor")


def _custom_logitsprocs(runner) -> bool:
    procs = runner.input_batch.sampling_metadata.logitsprocs.all
    return any(type(p).__name__ not in _BUILTIN_PROCS for p in (procs() if callable(procs) else procs))


def tree_drafts_for(sp) -> bool:
    """Whether the tree sampler computes exactly what vLLM's sampler would for a request with these
    sampling params: temperature, top-k and top-p only.  Any other feature (penalties, min_p, min_tokens,
    logit_bias, allowed / bad words, structured output, thinking budget) turns drafting off for that
    request: it is sampled by vLLM's own sampler, one token per step, while the batch keeps its trees."""
    return sp is not None and not (
        sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0 or sp.min_p or sp.min_tokens
        or sp.logit_bias or sp.allowed_token_ids or sp.bad_words or sp.structured_outputs is not None
        or getattr(sp, "thinking_token_budget", None) is not None)


def _plain_requests(runner, widths) -> list[int]:
    """Rows of the batch sampled by vLLM's own sampler this step (no tree, or drafting off)."""
    custom = _custom_logitsprocs(runner)  # engine-wide processors may touch any request
    reqs = runner.input_batch.req_ids
    return [r for r in range(len(widths)) if widths[r] == 0 or custom
            or not tree_drafts_for(getattr(runner.requests.get(reqs[r]), "sampling_params", None))]


# fp32 logits a sampling chunk copies at most (64 MiB; top-k/top-p processing adds a few buffers of the same
# size): the tree sampler's memory stays bounded whatever the batch, tree and vocabulary, so vLLM's
# profiling run (which never sees a tree step) does not have to reserve it.
SAMPLER_MAX_ELEMS = 1 << 24


def verify_requests(tree: DecodingTree | None, nodes, logits: torch.Tensor, starts: torch.Tensor, temperature=None,
                    top_k=None, top_p=None, generator=None, argmax: torch.Tensor | None = None,
                    max_elems: int | None = None):
    """Verify G requests with the same tree whose ``1 + w`` logits rows start at ``starts`` [G] of ``logits``
    [T, V] (``tree`` None: w = 0, plain sampling of one token).  Returns (tokens [G, 1 + w] int64, -1
    padded; accepted slots per request).

    Greedy (``temperature`` None) reads only ``argmax`` [T] (computed once per step).  Sampling copies
    the rows in chunks of requests holding at most ``max_elems`` fp32 logits.
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
    chunk = max(1, budget // ((w + 1) * V))
    toks, accepted = [], []
    for c in range(0, G, chunk):
        sl = slice(c, c + chunk)
        pick = lambda x: None if x is None else x[sl]  # noqa: E731
        lg = logits[rows[sl]].float()                                             # [g, 1+w, V]
        t, tk, tp = pick(temperature), pick(top_k), pick(top_p)
        if tree is None:
            p = probs_from_logits(lg[:, 0], t, tk, tp)
            toks.append(torch.multinomial(p, 1, generator=generator))
            accepted += [[] for _ in range(lg.shape[0])]
            continue
        res = sample_verify(tree, nodes[sl], lg, t, tk, tp, generator=generator)
        toks.append(res.output_token_ids(nodes[sl], width=w + 1).to(dev))
        accepted += res.accepted_slots
    return torch.cat(toks), accepted


def tree_sample(runner, drafter, step: TreeStep, logits: torch.Tensor, md):
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
        out[idx, 0] = runner.sampler(logits[roots], sm).sampled_token_ids[idx, 0].to(torch.int32)
    temp = None if sm.all_greedy or sm.temperature is None else sm.temperature
    gens = sm.generators or {}
    paths: dict[int, list[int]] = {}
    groups: dict[tuple, list[int]] = {}
    for r in sorted(set(range(B)) - set(plain)):
        groups.setdefault((int(widths[r]), r if r in gens else -1), []).append(r)
    argmax = logits.argmax(-1) if temp is None else None  # greedy: one pass over the logits, no copy
    for (w, seeded), reqs in groups.items():
        idx = torch.tensor(reqs, dtype=torch.long, device=dev)
        starts = torch.from_numpy(cu_s[reqs] - w - 1).to(dev)
        t = None if temp is None else temp[idx]
        tk = None if sm.top_k is None else sm.top_k[idx]
        tp = None if sm.top_p is None else sm.top_p[idx]
        dstart = torch.from_numpy(cu_d[reqs] - w).to(dev)              # plain requests (w = 0) are done above
        nodes = draft[dstart[:, None] + torch.arange(w, device=dev)]                # [G, w]
        sub = drafter.subtrees.prefix(drafter.drafted_k, w)
        toks, accepted = verify_requests(sub, nodes, logits, starts, t, tk, tp, gens.get(seeded), argmax)
        out[idx, : w + 1] = toks.to(torch.int32)
        for i, r in enumerate(reqs):
            if accepted[i]:
                paths[r] = accepted[i]
    logprobs = None
    if sm.max_num_logprobs is not None:
        logprobs = _logprobs(runner, logits, out, cu_s - widths - 1, paths, sm.max_num_logprobs)
    if paths:
        _compact(runner, drafter, step, paths)
    drafter.record_tree_step(widths, paths)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)


def _logprobs(runner, logits, out, starts, paths, num_logprobs):
    """Target logprobs of every emitted token (and the top ``num_logprobs``), in vLLM's layout.

    Output column j of a request was predicted at the slot before it on the accepted path (the
    root for j = 0), so its logits row is that slot's.
    """
    B, width = out.shape
    rows = np.repeat(np.asarray(starts, dtype=np.int64)[:, None], width, 1)
    for r, path in paths.items():
        rows[r, 1: len(path) + 1] += np.asarray(path)
    lg = logits[torch.from_numpy(rows.reshape(-1)).to(logits.device)]
    lp = runner.sampler.compute_logprobs(lg)
    return runner.sampler.gather_logprobs(lp, num_logprobs, out.reshape(-1).clamp(min=0).long())


def _compact(runner, drafter, step: TreeStep, paths: dict[int, list[int]]) -> None:
    """Move the accepted nodes' K/V and per-token buffers next to the root (path order)."""
    src, dst = [], []
    for r, path in paths.items():
        root = int(step.root_rows[r])
        for i, s in enumerate(path):
            if s != i + 1:  # already in place otherwise (decided on the host: no device sync)
                src.append(root + s)
                dst.append(root + 1 + i)
    if not src:
        return
    dev = runner.positions.device
    src_t = torch.tensor(src, dtype=torch.long, device=dev)
    dst_t = torch.tensor(dst, dtype=torch.long, device=dev)
    slots_src = step.slot_mapping[src_t].long()
    slots_dst = step.slot_mapping[dst_t].long()
    compact_kv(_target_kv_caches(runner, drafter), slots_src, slots_dst, cache=runner)
    ids = runner.input_ids.gpu
    ids[dst_t] = ids[src_t]
    runner.positions[dst_t] = runner.positions[src_t]
    hidden = getattr(runner, "_falcon_hidden_states", None)
    if hidden is not None:
        hidden[dst_t] = hidden[src_t]


def _use_compaction_kernel(kvs) -> bool:
    """The one-launch Triton compaction serves CUDA caches in the FLASH_ATTN layout."""
    if not kvs or not all(kv.is_cuda and layout == "flash" for kv, layout in kvs):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compact_kv(kvs: list[tuple[torch.Tensor, str]], src: torch.Tensor, dst: torch.Tensor, cache=None,
               kernel: bool | None = None) -> None:
    """Copy flat slots ``src`` -> ``dst`` in every layer's K and V (dst <= src, dst increasing per request).

    On CUDA (FLASH_ATTN layout) one launch of ``kernels/kv_compaction.py`` moves all layers; elsewhere
    two index copies per layer.  ``kernel`` overrides the choice (tests run the Triton kernel under
    ``TRITON_INTERPRET=1`` on CPU tensors); ``cache`` keeps the kernel's plane pointer table.
    """
    if not (_use_compaction_kernel(kvs) if kernel is None else kernel):
        for kv, layout in kvs:
            copy_kv_slots(kv, layout, src, dst)
        return
    from falcon_vllm.kernels.kv_compaction import kv_compaction, plane_table

    key = tuple(kv.data_ptr() for kv, _ in kvs)
    table = getattr(cache, "_falcon_plane_table", None)
    if table is None or table[0] != key:  # cache tensors do not move: built once
        table = (key, plane_table([p for kv, layout in kvs for p in paged_kv(kv, layout)]))
        if cache is not None:
            cache._falcon_plane_table = table
    kv_compaction(table[1], src.contiguous(), dst.contiguous())


def install_runner_hooks() -> None:
    """Wrap the V1 runner's ``_prepare_inputs``, ``sample_tokens``, ``_sample`` and ``take_draft_token_ids``
    (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner._sample, "_falcon", False):
        return
    orig_prepare, orig_sample, orig_sample_tokens = (GPUModelRunner._prepare_inputs, GPUModelRunner._sample,
                                                     GPUModelRunner.sample_tokens)
    orig_take = GPUModelRunner.take_draft_token_ids

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        res = orig_prepare(self, scheduler_output, num_scheduled_tokens)
        CTX.verify = None
        self._falcon_tree_step = None
        drafter = _tree_drafter(self)
        if drafter is not None and res[1] is not None:
            self._falcon_tree_step = _begin_tree_step(self, drafter, res[1], num_scheduled_tokens)
        return res

    def sample_tokens(self, grammar_output):
        state = getattr(self, "execute_model_state", None)
        # the target hidden states of this step (reordered in place by the compaction)
        self._falcon_hidden_states = (state.hidden_states if state is not None and _tree_drafter(self) is not None
                                      else None)
        try:
            return orig_sample_tokens(self, grammar_output)
        finally:
            self._falcon_hidden_states = None

    def _sample(self, logits, spec_decode_metadata):
        CTX.verify = None  # the target forward of this step is over
        step, self._falcon_tree_step = getattr(self, "_falcon_tree_step", None), None
        drafter = _tree_drafter(self)
        if step is None or drafter is None or spec_decode_metadata is None:
            return orig_sample(self, logits, spec_decode_metadata)
        self.input_batch.update_async_output_token_ids()
        return tree_sample(self, drafter, step, logits, spec_decode_metadata)

    def take_draft_token_ids(self):
        out = orig_take(self)
        if out is not None and _tree_drafter(self) is not None:
            # requests the tree sampler cannot serve exactly get no speculative tokens scheduled
            custom = _custom_logitsprocs(self)
            out.draft_token_ids = [t if not custom and tree_drafts_for(
                getattr(self.requests.get(rid), "sampling_params", None)) else []
                for rid, t in zip(out.req_ids, out.draft_token_ids)]
        return out

    for f in (_prepare_inputs, sample_tokens, _sample, take_draft_token_ids):
        f._falcon = True
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.sample_tokens = sample_tokens
    GPUModelRunner._sample = _sample
    GPUModelRunner.take_draft_token_ids = take_draft_token_ids


def install_attention_hooks() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    _wrap_attention_impl(CPUAttentionBackendImpl)
    try:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    except Exception:  # not importable on CPU builds
        return
    _wrap_attention_impl(FlashAttentionImpl)


def install() -> None:
    install_runner_hooks()
    install_attention_hooks()
