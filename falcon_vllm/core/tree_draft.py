"""Tree mode, the drafter's side: the trees a step drafts, the drafter's SAR tree passes, and the
step state the proposer owns.

:class:`TreeState` is all of tree mode's state.  The Falcon proposer owns it
(``FalconProposer.tree_state``) and the runner hooks of :mod:`falcon_vllm.vllm.tree_verify` reach it
through vLLM's own ``runner.drafter``; nothing is kept in module globals or stored on vLLM's objects.
One value crosses a step boundary, by the nature of speculative decoding: the tree the last
``propose()`` drafted (``drafted_k``) is the one the next step verifies.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from falcon_vllm.kernels.tree_attention import causal_tree_bits, pack_mask_rows, pack_tree_mask
from falcon_vllm.tree import DecodingTree
from falcon_vllm.core.paged_kv import dense_attention, kv_layout, paged_kv, to_device

logger = logging.getLogger(__name__)


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



class TreeState:
    """Tree mode's state, owned by the proposer.

    ``drafted_k``: nodes per request drafted by the last ``propose()`` (the next step verifies that
    tree, cut by the scheduler to each request's scheduled width); ``step``: this step's verification
    plan (:class:`falcon_vllm.vllm.tree_verify.TreeStep`), built by ``_prepare_inputs`` and taken by
    ``_sample``; ``hidden_states``: the target hidden states of the step being sampled (the compaction
    reorders them); ``plane_table``: the compaction kernel's pointer table (the caches never move).
    ``steps`` / ``accepted_per_depth``: verified tree steps and drafts that reached each depth.
    """

    def __init__(self, tree: DecodingTree, sized: dict | None = None):
        self.subtrees = SubtreeCache(tree, sized)
        self.drafted_k = tree.num_nodes
        self.step = None
        self.hidden_states: torch.Tensor | None = None
        self.plane_table = None
        self.steps = 0
        self.accepted_per_depth = [0] * tree.max_depth

    def drafted(self, width: int) -> DecodingTree:
        """The tree a request with ``width`` scheduled nodes verifies."""
        return self.subtrees.prefix(self.drafted_k, width)

    def record(self, widths, paths: dict[int, list[int]]) -> None:
        """Per-depth acceptance of a verified tree step (called by the tree sampler)."""
        for r, w in enumerate(widths):
            if w > 0:
                self.steps += 1
                for d in range(len(paths.get(r, ()))):
                    self.accepted_per_depth[d] += 1


def cuda_tree_kernel(q: torch.Tensor):
    """The Triton tree-attention kernel for CUDA tensors; None on other devices or without triton (the torch
    paths are still exact).  Target attention (``tree_verify._attn_fn``) and the drafter's passes pick with it."""
    if q.is_cuda:
        try:
            from falcon_vllm.kernels.tree_attention import tree_attention
            return tree_attention
        except ImportError:
            pass
    return None


def _draft_kernel(q: torch.Tensor, layout: str):
    """The attention function of the drafter's tree passes: on CUDA (FLASH_ATTN caches) the Triton tree-attention
    kernel, which reads the paged prefix in place; None elsewhere (the dense path)."""
    return cuda_tree_kernel(q) if layout == "flash" else None


class DraftTreeAttention:
    """The drafter's SAR tree passes of one step, batched: one attention call per layer and pass.

    Block j of request r in pass t sees the drafter's paged prefix of r (``prefix_lens[r]``
    positions), the K/V of its ancestor blocks from the earlier tree passes of this step (kept
    here, never written to the paged cache), and its own k tokens (non-causal).  The in-flight keys
    of a pass are [all blocks of the earlier passes | this pass's blocks], seen through one mask per
    query row (ancestor blocks and own block) shared by all requests and layers.

    On CUDA the Triton tree-attention kernel reads the prefix through the block table and the
    in-flight keys apart from the queries (``kv_start_loc``, ``group=k``): no copy of the prefix.
    Elsewhere (CPU) every request's prefix is gathered once per layer and step into a padded
    [B, P_max] tensor and one masked SDPA per layer and pass attends to [prefix | in-flight keys].
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
        self.own: torch.Tensor | None = None    # [nb * k, keys of earlier passes + nb * k] bool, this pass
        self._mask: torch.Tensor | None = None  # dense path: [B, nb * k, P + in-flight keys]
        self._bits = None                       # kernel path: (tree bits, query and key start locs)
        self._sizes: list[int] = []             # blocks of each pass begun so far
        self._prefix: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin_pass(self, chain: torch.Tensor) -> None:
        """chain [nb, passes so far]: the ancestor block of each block in every earlier pass."""
        nb, t = chain.shape
        k = self.k
        sizes = self._sizes
        if len(sizes) != t:
            raise ValueError(f"falcon-vllm: begin_pass: {t} earlier passes in the chain, {len(sizes)} passes run")
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
        self.own = own
        self._mask = self._bits = None          # built by the first layer of the pass, for its path

    @property
    def mask(self) -> torch.Tensor:
        """The dense path's mask of this pass: [B, nb * k, P + in-flight keys] (prefix length per request)."""
        if self._mask is None:
            dev = self.prefix_lens.device
            nq = self.own.shape[0]
            pmask = torch.arange(self.P, device=dev)[None, None] < self.prefix_lens[:, None, None]
            self._mask = torch.cat([pmask.expand(self.B, nq, self.P),
                                    self.own.to(dev)[None].expand(self.B, -1, -1)], dim=2)
        return self._mask

    def _kernel_args(self):
        """The kernel path's tree bits [B * nb * k, words] and query / key start locations [B+1] of this pass."""
        if self._bits is None:
            dev = self.prefix_lens.device
            nq, nk = self.own.shape
            r = torch.arange(self.B + 1, dtype=torch.int32)
            bits, qsl, ksl = to_device([pack_mask_rows(self.own).repeat(self.B, 1), r * nq, r * nk], dev)
            self._bits = (bits, qsl, ksl, self.prefix_lens.to(torch.int32))
        return self._bits

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

    alone = True  # serves every row of the drafter's layers (see paged_kv.tree_attention_scope)

    def wants(self, md) -> bool:
        return True

    def attend(self, impl, layer, q, key, value, kv_cache, md, output):
        name = layer.layer_name
        B, nb, k = self.B, self.nb, self.k
        n = B * nb * k
        H, D, hkv = q.shape[1], q.shape[2], key.shape[1]
        own_k = key[:n].reshape(B, nb * k, hkv, D)
        own_v = value[:n].reshape(B, nb * k, hkv, D)
        hist = self.store.setdefault(name, [])
        layout = kv_layout(impl, layer)
        kc, vc = paged_kv(kv_cache, layout)
        out = output.view(-1, H, D)
        fn = _draft_kernel(q, layout)
        if fn is not None:
            bits, qsl, ksl, plens = self._kernel_args()
            keys = torch.cat([h[0] for h in hist] + [own_k], dim=1).reshape(-1, hkv, D)
            vals = torch.cat([h[1] for h in hist] + [own_v], dim=1).reshape(-1, hkv, D)
            o = fn(q[:n], keys, vals, kc, vc, self.block_table, plens, qsl, bits, impl.scale,
                   max_query_len=nb * k, max_prefix_len=self.P, kv_start_loc=ksl, group=k)
        else:
            pk, pv = self._padded_prefix(name, kc, vc)
            keys = torch.cat([pk] + [h[0] for h in hist] + [own_k], dim=1)
            vals = torch.cat([pv] + [h[1] for h in hist] + [own_v], dim=1)
            o = dense_attention(q[:n].reshape(B, nb * k, H, D), keys, vals, self.mask, impl.scale)
        out[:n] = o.reshape(n, H, D).to(out.dtype)
        hist.append((own_k.clone(), own_v.clone()))
        return output


def draft_tree(core, rows: torch.Tensor, positions: torch.Tensor, K: int, block_table: torch.Tensor,
               max_prefix: int) -> torch.Tensor:
    """The SAR tree passes of the drafting core ``core`` (a :class:`~falcon_vllm.core.drafting.FalconDrafting`)
    after the relaxed block (rows [B, k, H] at positions [B, k]); returns the node tokens [B, K].  ``K`` may be
    below the tree size (vLLM's dynamic speculation); the first K nodes (in slot order, parents first) form a valid
    tree and only the passes it needs are run.  The passes attend to the paged prefix (``block_table`` [>=B,
    blocks], at most ``max_prefix`` positions) and their ancestor blocks."""
    tree = core.tree_state.subtrees.get(K)
    core.tree_state.drafted_k = K
    B, k, H = rows.shape
    prefix = positions[:, -1].long() + 1         # drafter positions 0..n-1 are in the paged cache
    attn = DraftTreeAttention(block_table[:B], prefix, k, max_prefix=max_prefix)
    offs = torch.arange(k, device=rows.device)

    def run_pass(p, ids, feats, ancestors):
        nb = ids.shape[1]
        pos = (prefix[:, None, None] + k * (p - 1) + offs).expand(B, nb, k)
        attn.begin_pass(ancestors)
        out = core._tree_block_pass(attn, ids.reshape(B * nb, k), feats.reshape(B * nb, k, H),
                                    pos.reshape(B * nb, k))
        return out.view(B, nb * k, H)

    nodes = tree.draft(rows, lambda r: core._topk(r, tree.topk), run_pass)
    if core.steps == 1:
        logger.info("falcon-vllm: drafted a %d-node tree in %d drafter passes (k=%d)", tree.num_nodes,
                    tree.num_passes, k)
    return nodes
