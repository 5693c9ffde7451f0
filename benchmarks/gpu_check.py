#!/usr/bin/env python
"""Every piece of tree mode's CUDA path that touches GPU memory, against a dense fp32 oracle, without vLLM.

    python benchmarks/gpu_check.py                              # CUDA GPU: the full grid (34 cases)
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --quick   # CPU: small grid, Triton interpreted

Each case is one verification step of B requests on vLLM 0.32 FLASH_ATTN KV caches: the logical per-layer
view [num_blocks, Hkv, block_size, 2 D] (K | V along the last dim) over one raw buffer, with the strides of a
``KVCacheLayout`` (vLLM's own ``create_kv_cache_views`` when vLLM is importable, else the same arithmetic
here, compared with vLLM's wherever both exist), filled through a slot mapping (physical blocks shuffled).
Requests cycle through a full tree, a tree cut short by the scheduler (its first w nodes) and a request without
a tree (1-3 causal rows); prefixes are never a multiple of the block size.  Pieces, all through the plugin's
own functions (``falcon_vllm.vllm.tree_verify`` / ``tree_draft`` / ``paged_kv``):

* ``step``: ``_begin_tree_step`` (node positions = root + depth, the step's slot mapping and attention);
* ``attn-whole``: ``VerifyTreeAttention.attend`` serving the whole batch (tree rows under their ancestor
  mask, the others causally), through ``_attn_fn`` (CUDA: the Triton kernel), every layer;
* ``attn-rows``: the same with a prefill chunk in the batch (only tree rows recomputed, others untouched);
* ``draft``: ``DraftTreeAttention`` over every SAR tree pass of the tree (paged prefix + ancestor blocks),
  through ``_draft_kernel`` (CUDA: the Triton kernel, queries apart from their in-flight keys, and the dense
  path beside it for its time and memory; CPU: the dense path, and the kernel interpreted);
* ``compact-kernel`` / ``compact-copies``: ``compact_kv`` (one ``kv_compaction`` launch / ``copy_kv_slots``);
* ``sampler-*``: ``tree_sample`` (greedy; top-k 1 in single-request chunks, which must equal greedy;
  temperature + top-p, checked structurally) and the compaction it runs on the caches, input ids,
  positions and hidden states; ``sampler-128k`` (CUDA only): B=64, a 128k vocabulary, peak memory;
* ``chain-graph``: the chain drafting step of Model Runner V2 (``FalconDrafting.chain_program``) with a stand-in
  drafter, its batch padded to a captured size; on CUDA captured in one CUDA graph and replayed
  (``chain_graph.py``).

On CUDA every piece also gets its host syncs counted (``torch.cuda.set_sync_debug_mode("warn")``; the
target attention, the drafter's kernel path and the compaction kernel must have none) and attributed to the
Python lines that caused them, its peak extra memory and its time (CUDA events, median).  On CPU those
columns are skipped.  vLLM objects the pieces need are vLLM's own when ``import vllm`` works (or stand-ins
with ``--stub-vllm``), else minimal stand-ins installed in ``sys.modules`` for the run: the attention impl (its
class name and ``scale``), ``FlashAttentionMetadata`` and ``SamplerOutput``.  The runner, its input batch and
sampling metadata are duck-typed namespaces either way (vLLM needs an engine to build them).  Results: a table
on stdout, ``<out-dir>/<name>.{json,md}``; exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.machinery
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
import types
import warnings
import zlib

import numpy as np
import torch

from harness.paths import RESULTS, ROOT

# KVCacheLayout: stride order of the logical [L, B(locks), H, N(slots), C] axes (vllm/v1/kv_cache_layout.py)
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
SENTINEL = 7.0  # output rows a piece must not touch
PIECES = ("step", "attn-whole", "attn-rows", "draft", "compact-kernel", "compact-copies",
          "sampler-greedy", "sampler-topk1", "sampler-topp", "sampler-128k", "chain-graph")


@dataclasses.dataclass(frozen=True)
class Case:
    tree: str
    B: int
    dtype: str
    hq: int
    hkv: int
    d: int
    bs: int
    layout: str

    @property
    def id(self) -> str:
        return f"{self.tree} B={self.B} {self.dtype} {self.hq}/{self.hkv}x{self.d} bs{self.bs} {self.layout}"


# The CPU grid is the GPU grid scaled down for Triton's interpreter: heads 32/8, 32/32, 28/4 -> 8/2, 4/4, 7/1,
# batches 1 and 3 (a full tree, a cut tree, a request without a tree), fp32 and
# bf16, short prefixes, a small tree (tree-3x2x2) wherever the tree is not the axis checked.
GRIDS = {
    "full": dict(base=Case("falcon-llama", 8, "float16", 32, 8, 128, 16, "LBNHC"),
                 trees=("falcon-llama", "falcon-vicuna", "random-256"), batches=(1, 8, 64),
                 dtypes=("float16", "bfloat16"), cross_dtypes=True, heads=((32, 8), (32, 32), (28, 4)),
                 head_dims=(64, 128), block_sizes=(16, 64), layouts=tuple(LAYOUTS), max_prefix=2000, vocab=32000,
                 layers=2),
    "quick": dict(base=Case("tree-3x2x2", 3, "float32", 2, 1, 64, 16, "LBNHC"),
                  trees=("falcon-llama", "falcon-vicuna", "random-256"), batches=(1, 3),
                  dtypes=("float32", "bfloat16"), cross_dtypes=True, heads=((8, 2), (4, 4), (7, 1)),
                  head_dims=(64, 128), block_sizes=(16, 64), layouts=tuple(LAYOUTS), max_prefix=90, vocab=512,
                  layers=2),
}


def grid(g: dict) -> list[Case]:
    """Trees x batch sizes (x dtypes), then dtypes, head shapes x head dims x block sizes, layouts, around the base."""
    b, rep = g["base"], dataclasses.replace
    cases = [rep(b, tree=t, B=n, dtype=dt) for t in g["trees"] for n in g["batches"]
             for dt in (g["dtypes"] if g["cross_dtypes"] else g["dtypes"][:1])]
    cases += [rep(b, dtype=dt) for dt in g["dtypes"]]
    cases += [rep(b, hq=h, hkv=kv, d=d, bs=bs)
              for h, kv in g["heads"] for d in g["head_dims"] for bs in g["block_sizes"]]
    cases += [rep(b, layout=lay) for lay in g["layouts"]]
    return list(dict.fromkeys(cases))


# ---------------------------------------------------------------------------- imports, vLLM stand-ins
def import_plugin():
    """falcon_vllm, installed or from this checkout (``kernels/`` is the package ``falcon_vllm.kernels``)."""
    try:
        import falcon_vllm.kernels  # noqa: F401
    except ImportError:
        sys.path.insert(0, ROOT)
        import falcon_vllm
        where = os.path.join(ROOT, "kernels")
        spec = importlib.util.spec_from_file_location("falcon_vllm.kernels", os.path.join(where, "__init__.py"),
                                                      submodule_search_locations=[where])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["falcon_vllm.kernels"] = falcon_vllm.kernels = mod
        spec.loader.exec_module(mod)
    from falcon_vllm.vllm import tree_verify
    return tree_verify


class FlashAttentionImpl:  # stand-in: tree mode reads the class name (kv_layout: "FlashAttention...") and scale
    pass


@dataclasses.dataclass
class FlashAttentionMetadata:  # stand-in: the required fields of vLLM 0.32's FlashAttentionMetadata
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


@dataclasses.dataclass
class SamplerOutput:  # stand-in of vllm.v1.outputs.SamplerOutput
    sampled_token_ids: torch.Tensor
    logprobs_tensors: object


_STUBS = {"vllm": {}, "vllm.v1": {}, "vllm.v1.attention": {}, "vllm.v1.attention.backends": {},
          "vllm.v1.attention.backends.flash_attn": {"FlashAttentionImpl": FlashAttentionImpl,
                                                     "FlashAttentionMetadata": FlashAttentionMetadata},
          "vllm.v1.outputs": {"SamplerOutput": SamplerOutput}}


@contextlib.contextmanager
def vllm_objects(force_stub: bool = False):
    """vLLM's FLASH_ATTN impl and metadata classes (``real``: vLLM's own); stand-ins when vLLM cannot be
    imported, in sys.modules for the duration so that the plugin's own ``from vllm... import`` finds them."""
    if not force_stub:
        try:
            import vllm  # noqa: F401
        except ImportError:
            pass
        else:
            from vllm.v1.attention.backends import flash_attn as fa
            yield types.SimpleNamespace(real=True, Impl=fa.FlashAttentionImpl, Metadata=fa.FlashAttentionMetadata)
            return
    saved = {name: sys.modules.get(name) for name in _STUBS}
    for name, attrs in _STUBS.items():
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        if "." in name:
            setattr(sys.modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1], mod)
    try:
        yield types.SimpleNamespace(real=False, Impl=FlashAttentionImpl, Metadata=FlashAttentionMetadata)
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def flash_kv_views(raw, L, nb, hkv, bs, d, dtype, layout):
    """vLLM 0.32's per-layer FLASH_ATTN views over one raw int8 buffer: logical [nb, hkv, bs, 2 d] (bytes
    in the last axis, then viewed as ``dtype``) with the strides of ``layout`` (compute_layout_strides)."""
    shape = (L, nb, hkv, bs, 2 * d * torch.empty((), dtype=dtype).element_size())
    strides, cur = [0] * 5, 1
    for dim in reversed(LAYOUTS[layout]):
        strides[dim], cur = cur, cur * shape[dim]
    assert raw.numel() == cur
    v5 = torch.as_strided(raw, shape, strides)
    return [v5[i].view(dtype) for i in range(L)]


def kv_caches(ns, L, nb, hkv, bs, d, dtype, layout, dev):
    """L layer caches; with vLLM importable, built by vLLM's allocator code and compared with ``flash_kv_views``
    (returns the caches and whether vLLM's own views were used)."""
    nbytes = L * nb * hkv * bs * 2 * d * torch.empty((), dtype=dtype).element_size()
    raw = torch.zeros(nbytes, dtype=torch.int8, device=dev)
    ours = flash_kv_views(raw, L, nb, hkv, bs, d, dtype, layout)
    if not ns.real:
        return ours, False
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, compute_layout_strides,
                                            create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype)
    lay = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, nb, L, lay)
    t = KVCacheTensor(size=nbytes, layers=[f"l{i}" for i in range(L)], layer_stride=layer_stride,
                      block_stride=block_stride)
    theirs = create_kv_cache_views(raw, spec, nb, lay, t)
    for a, b in zip(ours, theirs):
        if (a.shape, a.stride(), a.storage_offset(), a.dtype) != (b.shape, b.stride(), b.storage_offset(), b.dtype):
            raise AssertionError(f"stand-in KV view {tuple(a.shape)} {a.stride()} differs from vLLM's "
                                 f"{tuple(b.shape)} {b.stride()} ({layout})")
    return theirs, True


# ---------------------------------------------------------------------------- oracles (dense, fp32)
def oracle_attention(q, keys, vals, mask, scale):
    """q [W, Hq, D], keys/vals [L, Hkv, D], mask [W, L] bool (query row may see key) -> [W, Hq, D] fp32."""
    rep = q.shape[1] // keys.shape[1]
    k, v = keys.float().repeat_interleave(rep, 1), vals.float().repeat_interleave(rep, 1)
    s = torch.einsum("whd,lhd->hwl", q.float(), k) * scale
    p = s.masked_fill(~mask[None], float("-inf")).softmax(-1)
    return torch.einsum("hwl,lhd->whd", p, v)


def oracle_ancestors(parent: list[int], n: int) -> torch.Tensor:
    """[n, n] bool: slot j is slot i or an ancestor of it (the first n slots of a tree, parents first)."""
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parent[j]
    return m


def oracle_greedy(parent, tokens, amax, w):
    """Greedy tree walk: from the root, follow the child whose token is its parent's argmax.  tokens[s] for slots
    1..w, amax[s] for slots 0..w.  Returns (accepted slots, bonus token)."""
    u, path = 0, []
    while True:
        nxt = [c for c in range(1, w + 1) if parent[c] == u and tokens[c] == amax[u]]
        if not nxt:
            return path, int(amax[u])
        u = nxt[0]
        path.append(u)


def oracle_support(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[R, V] bool: tokens with nonzero probability after temperature and top-p (a token is kept iff the mass
    of the more likely tokens before it is below top_p; the most likely is always kept)."""
    p, idx = (logits.float() / temperature).softmax(-1).sort(-1, descending=True)
    before = torch.cat([torch.zeros_like(p[:, :1]), p.cumsum(-1)[:, :-1]], -1)
    keep = before < top_p
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(-1, idx, keep)


# ---------------------------------------------------------------------------- a verification step
def make_tree(name: str):
    from falcon_vllm.tree import DecodingTree, build_tree

    if name.startswith("random-"):  # a random tree of n nodes (ranks 0..3 under any existing node), k = 2
        n = int(name[7:])
        rng = np.random.default_rng(n)
        paths, seen = [(0,)], {(0,)}
        while len(paths) < n:
            child = paths[rng.integers(len(paths))] + (int(rng.integers(4)),)
            if child not in seen:
                seen.add(child)
                paths.append(child)
        return DecodingTree([list(p) for p in paths], 2, name)
    return build_tree(name, 2)


class Step:
    """Caches, requests, runner stand-in and oracle data of one case."""

    def __init__(self, case: Case, ns, dev, layers: int, max_prefix: int, vocab: int, all_full: bool = False):
        from falcon_vllm.core.tree_draft import TreeState

        self.case, self.dev, self.L = case, dev, layers
        seed = zlib.crc32(case.id.encode())
        self.g = torch.Generator(device=dev).manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.tree = tree = make_tree(case.tree)
        N, B, bs = tree.num_nodes, case.B, case.bs
        self.parent = tree.parent.tolist()
        # request r: a full tree (r % 3 == 0), a tree cut short (1), no tree: 1-3 causal rows (2)
        self.widths = np.array([N if r % 3 == 0 or all_full else max(1, N * (r % 7 + 1) // 9) if r % 3 == 1 else 0
                                for r in range(B)], dtype=np.int64)
        self.n_sched = np.where(self.widths > 0, self.widths + 1, 1 + (np.arange(B) // 3) % 3)
        P = [1 + (int(max_prefix * 0.26) + 389 * r) % max_prefix for r in range(B)]
        self.P = np.array([p + 1 if p % bs == 0 else p for p in P], dtype=np.int64)
        self.qsl = np.concatenate([[0], np.cumsum(self.n_sched)])
        self.T = T = int(self.qsl[-1])
        self.pad = 2                                       # vLLM pads the token buffers
        nblk = [-(-int(p + n) // bs) for p, n in zip(self.P, self.n_sched)]
        self.nb = nb = sum(nblk) + 2
        perm = torch.from_numpy(rng.permutation(nb)).int()
        table = torch.zeros(B, max(nblk), dtype=torch.int32)
        for r, c in enumerate(np.cumsum([0] + nblk[:-1])):
            table[r, : nblk[r]] = perm[c: c + nblk[r]]
        self.table = table.to(dev)
        dtype = self.dtype = getattr(torch, case.dtype)
        # token rows: request r's rows qsl[r]:qsl[r+1] at positions P_r + i, slots through the block table
        self.req_of = np.repeat(np.arange(B), self.n_sched)
        pos = np.concatenate([self.P[r] + np.arange(self.n_sched[r]) for r in range(B)])
        blk = table[torch.from_numpy(self.req_of), torch.from_numpy(pos // bs)].long()
        slots = blk * bs + torch.from_numpy(pos % bs)
        self.slot_mapping = torch.cat([slots, torch.full((self.pad,), -1)]).to(dev)
        self.positions0 = torch.cat([torch.from_numpy(pos), torch.zeros(self.pad, dtype=torch.long)]).to(dev)
        self.prefix_slots = [(table[r].long()[torch.arange(int(self.P[r])) // bs] * bs
                              + torch.arange(int(self.P[r])) % bs).to(dev) for r in range(B)]
        # KV caches: L target layers + 1 drafter layer; every slot first holds garbage, then the prefix and the
        # step's K/V are written through the slot mapping (the in-flight K/V too, as vLLM writes them before
        # attention).  truth[l]: [slots, Hkv, 2 D], what every slot of layer l holds.
        self.caches, self.vllm_views = kv_caches(ns, layers + 1, nb, case.hkv, bs, case.d, dtype, case.layout, dev)
        self.truth = []
        for kv in self.caches:
            t = self.randn(nb * bs, case.hkv, 2 * case.d)
            kv.copy_(t.view(nb, bs, case.hkv, -1).transpose(1, 2))        # garbage everywhere
            for r in range(B):
                new = self.randn(int(self.P[r] + self.n_sched[r]), case.hkv, 2 * case.d)
                s = torch.cat([self.prefix_slots[r], self.slot_mapping[self.qsl[r]: self.qsl[r + 1]]])
                kv[s // bs, :, s % bs] = new                                 # the slot mapping's writes
                t[s] = new
            self.truth.append(t)
        self.q = [self.randn(T + self.pad, case.hq, case.d) for _ in range(layers)]
        self.k = [torch.cat([t[self.slot_mapping[:T], :, : case.d], self.randn(self.pad, case.hkv, case.d)])
                  for t in self.truth[:layers]]
        self.v = [torch.cat([t[self.slot_mapping[:T], :, case.d:], self.randn(self.pad, case.hkv, case.d)])
                  for t in self.truth[:layers]]
        impl = ns.Impl.__new__(ns.Impl)
        impl.scale, impl.head_size, impl.num_heads, impl.num_kv_heads = case.d ** -0.5, case.d, case.hq, case.hkv
        self.impl = impl
        self.layers = [types.SimpleNamespace(layer_name=f"model.layers.{i}.attn", kv_cache=kv, impl=impl)
                       for i, kv in enumerate(self.caches[:layers])]
        self.draft_layer = types.SimpleNamespace(layer_name="drafter.attn", kv_cache=self.caches[-1], impl=impl)
        seq = torch.from_numpy(self.P + self.n_sched).int()
        self.md = ns.Metadata(num_actual_tokens=T, max_query_len=int(self.n_sched.max()),
                              query_start_loc=torch.from_numpy(self.qsl).int().to(dev), max_seq_len=int(seq.max()),
                              seq_lens=seq.to(dev), block_table=self.table, slot_mapping=self.slot_mapping[:T])
        # the runner and the drafter, as far as tree mode reads them
        self.state = TreeState(tree)
        self.spec_md = types.SimpleNamespace(num_draft_tokens=self.widths.tolist())
        ctx = {lay.layer_name: lay for lay in self.layers + [self.draft_layer]}
        self.runner = types.SimpleNamespace(
            positions=self.positions0.clone(), input_ids=types.SimpleNamespace(gpu=None), requests={},
            input_batch=types.SimpleNamespace(
                block_table=[types.SimpleNamespace(slot_mapping=types.SimpleNamespace(gpu=self.slot_mapping))],
                req_ids=[f"req-{r}" for r in range(B)], update_async_output_token_ids=lambda: None),
            vllm_config=types.SimpleNamespace(compilation_config=types.SimpleNamespace(static_forward_context=ctx)),
            drafter=types.SimpleNamespace(tree_state=self.state, _draft_attn_layer_names=[self.draft_layer.layer_name]),
            sampler=lambda logits, sm: types.SimpleNamespace(sampled_token_ids=logits.argmax(-1, keepdim=True)))
        plain = types.SimpleNamespace(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0,
                                      min_tokens=0, logit_bias=None, allowed_token_ids=None, bad_words=None,
                                      structured_outputs=None)
        self.runner.requests = {f"req-{r}": types.SimpleNamespace(sampling_params=plain) for r in range(B)}
        self.vocab, self.rng = vocab, rng
        self._expected = None

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g, device=self.dev).to(self.dtype)

    def tree_rows(self):
        return [r for r in range(self.case.B) if self.widths[r] > 0]

    def mask(self, r: int) -> torch.Tensor:
        n, P = int(self.n_sched[r]), int(self.P[r])
        own = oracle_ancestors(self.parent, n) if self.widths[r] else torch.ones(n, n, dtype=torch.bool).tril()
        return torch.cat([torch.ones(n, P, dtype=torch.bool), own], 1).to(self.dev)

    def expected_attention(self):
        """[layer] -> [T, Hq, D] fp32: each request's rows over its prefix + in-flight keys (dense oracle)."""
        if self._expected is None:
            d, out = self.case.d, []
            for layer in range(self.L):
                t, o = self.truth[layer], []
                for r in range(self.case.B):
                    s, e = int(self.qsl[r]), int(self.qsl[r + 1])
                    rows = torch.cat([self.prefix_slots[r], self.slot_mapping[s:e]])
                    o.append(oracle_attention(self.q[layer][s:e], t[rows, :, :d], t[rows, :, d:], self.mask(r),
                                              self.impl.scale))
                out.append(torch.cat(o))
            self._expected = out
        return self._expected

    def read_slots(self, kv) -> torch.Tensor:
        """What every slot of a layer cache holds, [slots, Hkv, 2 D] (read through the logical view)."""
        return kv.transpose(1, 2).reshape(self.nb * self.case.bs, self.case.hkv, -1)

    def restore(self):
        for kv, t in zip(self.caches, self.truth):
            kv.copy_(t.view(self.nb, self.case.bs, self.case.hkv, -1).transpose(1, 2))
        self.runner.positions.copy_(self.positions0)

    def begin(self):
        """The plugin's ``_begin_tree_step`` on fresh positions: the step's TreeStep (and its attention)."""
        from falcon_vllm.vllm import tree_verify

        self.runner.positions.copy_(self.positions0)
        return tree_verify._begin_tree_step(self.runner, self.state, self.spec_md, self.n_sched)

    def moves(self, paths: dict[int, list[int]]):
        """Token rows (src, dst) of the compaction of accepted paths, as the plugin must move them."""
        src, dst = [], []
        for r, path in paths.items():
            root = int(self.qsl[r])
            for i, s in enumerate(path):
                if s != i + 1:
                    src.append(root + s)
                    dst.append(root + 1 + i)
        return src, dst

    def check_moved(self, src_rows, dst_rows, extra=()) -> dict:
        """Every target layer's slots (and ``extra`` (tensor, original) pairs of token buffers) hold exactly what
        moving src -> dst rows makes of the original; the drafter's layer is untouched."""
        s, t = self.slot_mapping[src_rows], self.slot_mapping[dst_rows]
        bad = []
        for i, (kv, truth) in enumerate(zip(self.caches, self.truth)):
            want = truth.clone()
            if i < self.L:
                want[t] = truth[s]
            if not torch.equal(self.read_slots(kv), want):
                bad.append(f"layer {i}" if i < self.L else "drafter layer")
        for name, got, orig in extra:
            want = orig.clone()
            want[dst_rows] = orig[src_rows]
            if not torch.equal(got, want):
                bad.append(name)
        return dict(ok=not bad, note=f"{len(src_rows)} rows moved" + (f"; wrong: {', '.join(bad)}" if bad else ""))


# ---------------------------------------------------------------------------- measuring (CUDA)
def sync_sites(caught) -> dict[str, int]:
    """'file:line' -> count of the sync warnings among ``caught`` (warnings.WarningMessage), most first: the
    Python line that called the synchronizing op (paths relative to the checkout)."""
    sites = collections.Counter(f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    return dict(sites.most_common())


@contextlib.contextmanager
def syncs_counted(dev):
    box = types.SimpleNamespace(n=None, sites=None)
    if dev.type != "cuda":
        yield box
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield box
        finally:
            torch.cuda.set_sync_debug_mode("default")
    box.sites = sync_sites(caught)
    box.n = sum(box.sites.values())


@contextlib.contextmanager
def peak_memory(dev):
    box = types.SimpleNamespace(mib=None)
    if dev.type != "cuda":
        yield box
        return
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    yield box
    torch.cuda.synchronize()
    box.mib = (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def cuda_ms(fn, reps: int) -> float:
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


class Checker:
    def __init__(self, dev, reps: int, only):
        self.dev, self.reps, self.only, self.rows = dev, reps, only, []

    def wants(self, piece: str) -> bool:
        return not self.only or any(piece.startswith(o) for o in self.only)

    def piece(self, case_id, piece, path, prepare, run, check, per: int = 1, max_syncs: int | None = None):
        """prepare(); run() (once more first on CUDA: compilation, tables built once) with host syncs and peak
        memory counted; check(); then on CUDA the median time of ``reps`` more runs / ``per``."""
        row = dict(case=case_id, piece=piece, path=path, ok=False, err=None, tol=None, syncs=None, sync_sites=None,
                   peak_MiB=None, ms=None, note="")
        cuda = self.dev.type == "cuda"
        try:
            if cuda:
                prepare()
                run()
            prepare()
            with peak_memory(self.dev) as mem, syncs_counted(self.dev) as syncs:  # peak_memory's syncs outside
                run()
            row.update(check())
            row["syncs"], row["sync_sites"], row["peak_MiB"] = syncs.n, syncs.sites, mem.mib
            if max_syncs is not None and syncs.n is not None and syncs.n > max_syncs:
                row["ok"] = False
                more = f"{syncs.n} host syncs (expected <= {max_syncs})"
                row["note"] = f"{row['note']}; {more}" if row["note"] else more
            if cuda:
                row["ms"] = cuda_ms(run, self.reps) / per
        except Exception as e:  # a crash is a failed check, reported with the others
            traceback.print_exc()
            row.update(ok=False, note=f"{type(e).__name__}: {str(e)[:300]}")
        self.rows.append(row)
        print(fmt_row(row), flush=True)
        return row


def close(got, want, dtype) -> dict:
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    err = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
    ok = bool(torch.allclose(got.float(), want.float(), atol=tol, rtol=tol))
    return dict(ok=ok, err=err, tol=tol)


# ---------------------------------------------------------------------------- the pieces
def attn_paths(dev, triton_mode):
    """(label, attention function) to drive VerifyTreeAttention through: None is the plugin's own choice
    (``_attn_fn``: the Triton kernel for CUDA tensors); on CPU also the kernel, interpreted, in its place."""
    paths = [(None, None)]
    if dev.type == "cpu" and triton_mode:
        from falcon_vllm.kernels.tree_attention import tree_attention
        paths.append((triton_mode, tree_attention))
    return paths


@contextlib.contextmanager
def patched(mod, **attrs):
    old = {k: getattr(mod, k) for k in attrs}
    for k, v in attrs.items():
        setattr(mod, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(mod, k, v)


def check_step(ck: Checker, st: Step):
    depth = st.tree.depth.to(st.dev)
    box = {}

    def check():
        step, want = box["step"], st.positions0.clone()
        for r in st.tree_rows():
            s = int(st.qsl[r])
            want[s + 1: s + 1 + st.widths[r]] = st.P[r] + depth[1: st.widths[r] + 1]
        roots = np.where(st.widths > 0, st.qsl[:-1], -1).tolist()
        bad = [n for n, ok in (("positions", torch.equal(st.runner.positions, want)),
                               ("slot_mapping", torch.equal(step.slot_mapping, st.slot_mapping[: st.T])),
                               ("root_rows", step.root_rows.tolist() == roots),
                               ("whole", step.attention is not None and step.attention.whole)) if not ok]
        return dict(ok=not bad, note="wrong: " + ", ".join(bad) if bad else "")

    ck.piece(st.case.id, "step", "_begin_tree_step", lambda: None, lambda: box.update(step=st.begin()), check)


def check_v2_slots(ck: Checker, st: Step):
    """Model Runner V2's tree compaction finds the K/V slots of a request's rows from the block table and the root's
    position (the drafting core's ``kv_slots``, as ``v2/tree.py`` calls it), not from a captured slot mapping: they
    must be the step's slots."""
    from types import SimpleNamespace

    from falcon_vllm.core.drafting import FalconDrafting

    core = SimpleNamespace(block_size=st.case.bs, max_model_len=1 << 30)
    box = {}

    def run():
        box["got"] = [FalconDrafting.kv_slots(core, st.table[r:r + 1], torch.as_tensor(
            int(st.P[r]) + np.arange(st.widths[r] + 1), device=st.dev)[None]) for r in st.tree_rows()]

    def check():
        want = [st.slot_mapping[int(st.qsl[r]): int(st.qsl[r]) + st.widths[r] + 1].long() for r in st.tree_rows()]
        bad = [r for r, g, w in zip(st.tree_rows(), box["got"], want) if not torch.equal(g.long(), w)]
        return dict(ok=not bad, note=f"wrong slots for requests {bad[:4]}" if bad else "")

    ck.piece(st.case.id, "v2-slots", "FalconDrafting.kv_slots", lambda: None, run, check)


def check_target_attention(ck: Checker, st: Step, whole: bool, paths):
    from falcon_vllm.vllm import tree_verify

    case, T = st.case, st.T
    tree_rows = set(st.tree_rows())
    if not whole and len(tree_rows) == case.B:
        return  # only a request without a tree (a prefill chunk) makes the batch partial
    L = st.L if whole else 1  # whole: every layer through one attention object; partial: the first layer
    for path, fn in paths:
        if fn is None:  # the function the plugin picks for this device
            picked = tree_verify._attn_fn(st.q[0]).__name__
            path = {"tree_attention": "triton", "tree_attention_ref": "torch-ref"}.get(picked, picked)
        box = {}

        def prepare():
            with patched(tree_verify, MAX_CAUSAL_ROWS=tree_verify.MAX_CAUSAL_ROWS if whole else 0):
                box["att"] = st.begin().attention       # a prefill chunk in the batch: whole = False
            assert box["att"].whole == whole
            box["out"] = [torch.full((T + st.pad, case.hq * case.d), SENTINEL, dtype=st.dtype, device=st.dev)
                          for _ in range(L)]

        def run():
            ctx = patched(tree_verify, _attn_fn=lambda q: fn) if fn is not None else contextlib.nullcontext()
            with ctx:
                for i in range(L):  # one attention object per forward, every layer through it
                    box["att"].attend(st.impl, st.layers[i], st.q[i], st.k[i], st.v[i], st.caches[i], st.md,
                                      box["out"][i])

        def check():
            res, untouched = [], True
            for i, want in enumerate(st.expected_attention()[:L]):
                got = box["out"][i].view(T + st.pad, case.hq, case.d)
                rows = [x for r in range(case.B) if whole or r in tree_rows
                        for x in range(int(st.qsl[r]), int(st.qsl[r + 1]))]
                keep = sorted(set(range(T + st.pad)) - set(rows))
                res.append(close(got[rows], want[rows], st.dtype))
                untouched &= bool((got[keep] == SENTINEL).all())
            out = dict(ok=all(r["ok"] for r in res) and untouched, err=max(r["err"] for r in res), tol=res[0]["tol"])
            if not untouched:
                out["note"] = "rows outside the served requests were written"
            return out

        ck.piece(case.id, "attn-whole" if whole else "attn-rows", path, prepare, run, check, per=L, max_syncs=0)


def check_draft(ck: Checker, st: Step, paths):
    """The drafter's tree passes through each of ``paths`` (as for the target attention): None is the plugin's own
    choice (``_draft_kernel``: the Triton kernel for CUDA tensors, else the dense path); on CUDA also the dense
    path, for its time and memory beside the kernel's."""
    from falcon_vllm.core import tree_draft

    if st.dev.type == "cuda":
        paths = list(paths) + [("dense", "dense")]
    for path, fn in paths:
        if fn == "dense":
            ctx = patched(tree_draft, _draft_kernel=lambda q, layout: None)
        elif fn is None:
            picked = tree_draft._draft_kernel(st.q[0], "flash")
            path = "dense" if picked is None else {"tree_attention": "triton"}.get(picked.__name__, picked.__name__)
            ctx = contextlib.nullcontext()
        else:
            ctx = patched(tree_draft, _draft_kernel=lambda q, layout, fn=fn: fn)
        with ctx:
            check_draft_path(ck, st, path)


def check_draft_path(ck: Checker, st: Step, path: str):
    from falcon_vllm.core import tree_draft

    case, tree, k = st.case, st.tree, st.tree.k
    B, d = case.B, case.d
    names = [(st.draft_layer, st.caches[-1], st.truth[-1]), (st.layers[0], st.caches[0], st.truth[0])]
    prefix = torch.from_numpy(st.P).to(st.dev)
    passes = [tree.passes[p].ancestor_blocks for p in range(1, tree.num_passes)]
    inputs = [[tuple(st.randn(B * c.shape[0] * k, h, d) for h in (case.hq, case.hkv, case.hkv)) for _ in names]
              for c in passes]
    box = {}

    def prepare():
        box["out"] = [[torch.zeros(x[0].shape[0], case.hq * d, dtype=st.dtype, device=st.dev) for x in per]
                      for per in inputs]

    def run():  # one drafter step: its attention object, then every tree pass through every drafter layer
        att = tree_draft.DraftTreeAttention(st.table, prefix, k, max_prefix=st.md.max_seq_len)
        for p, chain in enumerate(passes):
            att.begin_pass(chain)
            for j, (layer, kv, _) in enumerate(names):
                q, kk, vv = inputs[p][j]
                att.attend(st.impl, layer, q, kk, vv, kv, None, box["out"][p][j])

    def check():
        res = []
        for j, (_, _, truth) in enumerate(names):
            hist = []                                        # per earlier pass: (K, V) [B, nb, k, Hkv, D]
            for p, chain in enumerate(passes):
                nb = chain.shape[0]
                q, kk, vv = (x.view(B, nb, k, -1, d) for x in inputs[p][j])
                got = box["out"][p][j].view(B, nb, k, case.hq, d)
                for r in range(B):
                    pk = truth[st.prefix_slots[r], :, :d]
                    pv = truth[st.prefix_slots[r], :, d:]
                    for b in range(nb):
                        anc = chain[b].tolist()
                        keys = torch.cat([pk] + [hist[t][0][r, anc[t]] for t in range(p)] + [kk[r, b]])
                        vals = torch.cat([pv] + [hist[t][1][r, anc[t]] for t in range(p)] + [vv[r, b]])
                        mask = torch.ones(k, keys.shape[0], dtype=torch.bool, device=st.dev)
                        res.append(close(got[r, b], oracle_attention(q[r, b], keys, vals, mask, st.impl.scale),
                                         st.dtype))
                hist.append((kk, vv))
        return dict(ok=all(r["ok"] for r in res), err=max(r["err"] for r in res), tol=res[0]["tol"],
                    note=f"{len(passes)} tree passes x {len(names)} layers")

    if passes:
        ck.piece(case.id, "draft", path, prepare, run, check, per=max(1, len(passes) * len(names)),
                 max_syncs=0 if path == "triton" else None)


def accepted_paths(st: Step) -> dict[int, list[int]]:
    """A random root-to-node path per tree request (the compaction pieces' accepted nodes)."""
    out = {}
    for r in st.tree_rows():
        s = int(st.rng.integers(0, st.widths[r] + 1))
        path = []
        while s > 0:
            path.insert(0, s)
            s = st.parent[s]
        if path:
            out[r] = path
    return out


def check_compaction(ck: Checker, st: Step, kernel: bool, path: str):
    from falcon_vllm.vllm import tree_verify

    src_rows, dst_rows = st.moves(accepted_paths(st))
    src, dst = st.slot_mapping[src_rows], st.slot_mapping[dst_rows]
    kvs = [(lay.kv_cache, "flash") for lay in st.layers]
    holder = types.SimpleNamespace(plane_table=None)  # the tree state keeps the kernel's pointer table
    ck.piece(st.case.id, "compact-kernel" if kernel else "compact-copies", path, st.restore,
             lambda: tree_verify.compact_kv(kvs, src, dst, state=holder, kernel=kernel),
             lambda: st.check_moved(src_rows, dst_rows), max_syncs=0 if kernel else None)


class SamplerData:
    """Target logits [sum(w + 1), V] and drafts with a planted greedy path per tree request (its tokens are their
    parent's argmax, boosted so that sampling accepts deep paths too; siblings get other tokens)."""

    def __init__(self, st: Step, scale: float = 3.0, boost: float = 4.0):
        self.st, V = st, st.vocab
        widths = st.widths
        self.cu = np.concatenate([[0], np.cumsum(widths + 1)])
        self.logits = (torch.randn(int(self.cu[-1]), V, generator=st.g, device=st.dev) * scale).float()
        amax = self.logits.argmax(-1).cpu().numpy()
        rank = st.tree.rank.tolist()
        tokens, self.oracle = [], {}
        for r in range(st.case.B):
            w = int(widths[r])
            if w == 0:
                continue
            a = amax[self.cu[r]: self.cu[r] + w + 1]
            target, on_path = int(st.rng.integers(0, w + 1)), set()
            while target > 0:
                on_path.add(target)
                target = st.parent[target]
            tok = [-1] + [int(a[st.parent[s]]) if s in on_path else (int(a[st.parent[s]]) + 1 + rank[s]) % V
                          for s in range(1, w + 1)]
            tokens += tok[1:]
            for s in on_path:
                self.logits[self.cu[r] + st.parent[s], tok[s]] += boost
            self.oracle[r] = (tok, a, oracle_greedy(st.parent, tok, a, w))
        self.draft = torch.tensor(tokens, dtype=torch.int32, device=st.dev)
        self.width = int(widths.max()) + 1

    def sm(self, mode: str):
        B, dev = self.st.case.B, self.st.dev
        t = {"greedy": None, "topk1": 1.0, "topp": 0.7}[mode]
        return types.SimpleNamespace(
            all_greedy=t is None, temperature=None if t is None else torch.full((B,), t, device=dev),
            top_k=torch.ones(B, dtype=torch.int32, device=dev) if mode == "topk1" else None,
            top_p=torch.full((B,), 0.9, device=dev) if mode == "topp" else None,
            generators={}, max_num_logprobs=None, logitsprocs=types.SimpleNamespace(all=[]))


def check_sampler(ck: Checker, st: Step, mode: str, data: SamplerData, piece: str | None = None):
    from falcon_vllm.vllm import tree_verify

    B, dev = st.case.B, st.dev
    sm = data.sm(mode)
    st.runner.input_batch.sampling_metadata = sm
    spec_md = types.SimpleNamespace(num_draft_tokens=st.widths.tolist(), draft_token_ids=data.draft)
    ids0 = torch.randint(0, st.vocab, (st.T + st.pad,), generator=st.g, device=dev).int()
    hidden0 = st.randn(st.T + st.pad, 16)
    kvs = [(lay.kv_cache, "flash") for lay in st.layers]
    path = "compaction: " + ("kernel" if tree_verify._use_compaction_kernel(kvs) else "index copies")
    # top-k 1: one request per logits chunk (the chunking is what a 128k vocabulary at B=64 needs)
    budget = data.width * st.vocab if mode == "topk1" else tree_verify.SAMPLER_MAX_ELEMS
    box = {}

    def prepare():
        st.restore()
        box["step"] = st.begin()
        box["pos0"] = st.runner.positions.clone()
        st.runner.input_ids.gpu = ids0.clone()
        st.state.hidden_states = hidden0.clone()
        torch.manual_seed(0)

    def run():
        with patched(tree_verify, SAMPLER_MAX_ELEMS=budget):
            box["out"] = tree_verify.tree_sample(st.runner, st.state, box["step"], data.logits, spec_md)

    def check():
        out = box["out"].sampled_token_ids
        got = out.tolist()
        notes, paths = [], {}
        if out.dtype != torch.int32 or tuple(out.shape) != (B, data.width):
            notes.append(f"output {out.dtype} {tuple(out.shape)}")
        plain_tok = data.logits[torch.from_numpy(data.cu[:-1]).to(dev)].argmax(-1).tolist()
        rows_seen = {}

        def support(row):  # the target's support at a logits row (sorted per row: a 128k vocabulary is large)
            if row not in rows_seen:
                rows_seen[row] = oracle_support(data.logits[row: row + 1], 0.7, 0.9)[0].cpu()
            return rows_seen[row]

        for r in range(B):
            row = got[r]
            if r not in data.oracle:                        # no tree: vLLM's sampler (here: greedy stand-in)
                want = [plain_tok[r]] + [-1] * (data.width - 1)
                if row != want:
                    notes.append(f"req {r}: {row[:4]} != {want[:4]}")
                continue
            tok, _, (opath, bonus) = data.oracle[r]
            w = int(st.widths[r])
            if mode != "topp":
                want = [tok[s] for s in opath] + [bonus]
                want += [-1] * (data.width - len(want))
                paths[r] = opath
                if row != want:
                    notes.append(f"req {r}: {row[:6]} != {want[:6]}")
                continue
            # sampling: the emitted tokens walk the tree; each in the target's support at its slot; the bonus is
            # none of the last slot's children (their tokens were rejected there)
            emitted = [t for t in row if t != -1]
            u, pth, ok = 0, [], len(emitted) >= 1 and row[len(emitted):] == [-1] * (data.width - len(emitted))
            for i, t in enumerate(emitted):
                ok &= bool(support(int(data.cu[r]) + u)[t])
                hit = [c for c in range(1, w + 1) if st.parent[c] == u and tok[c] == t]
                if i == len(emitted) - 1:                   # the bonus token
                    ok &= not hit
                elif hit:
                    u = hit[0]
                    pth.append(u)
                else:
                    ok = False
                    break
            paths[r] = pth
            if not ok:
                notes.append(f"req {r}: {row[:6]} is not a valid tree walk")
        if notes:
            return dict(ok=False, note="; ".join(notes[:4]))
        src_rows, dst_rows = st.moves({r: p for r, p in paths.items() if p})
        res = st.check_moved(src_rows, dst_rows, extra=[("input ids", st.runner.input_ids.gpu, ids0),
                                                        ("positions", st.runner.positions, box["pos0"]),
                                                        ("hidden states", st.state.hidden_states, hidden0)])
        acc = sum(len(p) for p in paths.values())
        res["note"] = f"{acc} nodes accepted; " + res["note"]
        if piece:
            res["note"] += f"; B={B}, V={st.vocab}: logits {data.logits.numel() * 4 / 2 ** 20:.0f} MiB fp32"
        return res

    ck.piece(st.case.id, piece or f"sampler-{mode}", path, prepare, run, check)


# ---------------------------------------------------------------------------- report
COLS = ("piece", "path", "ok", "err", "tol", "syncs", "peak_MiB", "ms", "note")


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "ok" if v else "FAIL"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


WIDTH = dict(case=48, piece=19, path=26, ok=4, err=8, tol=7, syncs=5, peak_MiB=8, ms=8, note=1)


def fmt_row(r) -> str:
    return " ".join(f"{fmt(r[c]):{WIDTH[c]}s}" for c in ("case",) + COLS)


def summary(rows) -> list[dict]:
    """Per (piece, path): checks, failures, worst error, most host syncs, largest peak memory, median time."""
    out = {}
    for r in rows:
        out.setdefault((r["piece"], r["path"]), []).append(r)

    def worst(rs, key, f=max):
        vals = [r[key] for r in rs if r[key] is not None]
        return f(vals) if vals else None

    def sites(rs):  # host syncs by call site, summed over the piece's checks
        total = collections.Counter()
        for r in rs:
            total.update(r.get("sync_sites") or {})
        return dict(total.most_common(8))

    return [dict(piece=p, path=path, checks=len(rs), failed=sum(not r["ok"] for r in rs), max_err=worst(rs, "err"),
                 max_syncs=worst(rs, "syncs"), max_peak_MiB=worst(rs, "peak_MiB"),
                 median_ms=worst(rs, "ms", statistics.median), sync_sites=sites(rs)) for (p, path), rs in out.items()]


def to_markdown(res) -> str:
    lines = [f"# GPU check: {res['device']}", "", f"Command: `{res['command']}`", "",
             f"torch {res['torch']}, triton {res['triton']}; vLLM objects: {res['vllm']}; "
             f"{res['cases']} cases, {res['checks']} checks, {res['failed']} failed, {res['seconds']:.0f} s.", "",
             "err: max abs error against the dense fp32 oracle (tol: atol = rtol); syncs: host syncs of one call "
             "(torch.cuda.set_sync_debug_mode); peak_MiB: peak extra GPU memory of one call; ms: median CUDA-event "
             "time per call, eager (launch overhead included; attention: per layer; draft: per pass and layer).  "
             "'-': not applicable or CPU.", "",
             "| piece | path | checks | failed | max err | max syncs | max peak MiB | median ms |", "|---" * 8 + "|"]
    for x in res["summary"]:
        lines.append(" | ".join(["", x["piece"], x["path"]] + [fmt(x[k]) for k in ("checks", "failed", "max_err",
                                 "max_syncs", "max_peak_MiB", "median_ms")] + [""]).strip())
    with_sites = [x for x in res["summary"] if x.get("sync_sites")]
    if with_sites:
        lines += ["", "Host syncs by call site (summed over each piece's checks, the 8 most frequent):", ""]
        lines += [f"- {x['piece']}: " + ", ".join(f"`{k}` {v}" for k, v in x["sync_sites"].items())
                  for x in with_sites]
    lines += ["", "| case | " + " | ".join(COLS) + " |", "|---" * (len(COLS) + 1) + "|"]
    for r in res["rows"]:
        lines.append(f"| {r['case']} | " + " | ".join(fmt(r[c]).replace("|", "/") for c in COLS) + " |")
    if res["skipped"]:
        lines += ["", "Skipped: " + "; ".join(res["skipped"])]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main
def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="the small grid (CPU: Triton through its interpreter)")
    p.add_argument("--only", default="", help=f"comma list of piece prefixes to run, of {', '.join(PIECES)}")
    p.add_argument("--stub-vllm", action="store_true", help="use the vLLM stand-ins even where vLLM is importable")
    p.add_argument("--reps", type=int, default=5, help="CUDA: timed repetitions per piece")
    p.add_argument("--name", default=None, help="results name (default gpu_check_<device>)")
    p.add_argument("--out-dir", default=RESULTS)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    t0 = time.time()
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu --quick", file=sys.stderr)
        return 2
    import_plugin()
    from falcon_vllm.kernels import tree_attention as ta

    triton_mode = None
    if ta.triton is not None:
        interp = type(ta._tree_attn_fwd).__name__ == "InterpretedFunction"
        triton_mode = {("cpu", True): "triton-interpreter", ("cuda", False): "triton"}.get((dev.type, interp))
    if dev.type == "cpu" and not a.quick:
        print("gpu_check: on CPU the Triton kernels run interpreted: use the small grid (--quick)", file=sys.stderr)
        return 2
    g = GRIDS["quick" if a.quick else "full"]
    ck = Checker(dev, a.reps, [o for o in a.only.split(",") if o])
    skipped = []
    if dev.type == "cuda" and triton_mode is None:
        skipped.append("the Triton kernels (triton is not importable)")
    if dev.type == "cpu":
        skipped.append("host-sync counts, peak memory, timings and sampler-128k (CUDA only)")
        if triton_mode is None:
            skipped.append("the Triton kernels (on CPU they need TRITON_INTERPRET=1 before triton is imported)")
    tf32, threads = torch.backends.cuda.matmul.allow_tf32, torch.get_num_threads()
    torch.backends.cuda.matmul.allow_tf32 = False                 # the oracle is fp32
    if dev.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: OpenMP threads only spin (x6 the CPU time on 2 busy cores)
    cases = grid(g)
    print(fmt_row({c: c for c in ("case",) + COLS}))
    rng = torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if dev.type == "cuda" else [])
    with vllm_objects(a.stub_vllm) as ns, rng:  # the sampler pieces seed torch's global generator
        try:
            for case in cases:
                try:
                    st = Step(case, ns, dev, g["layers"], g["max_prefix"], g["vocab"])
                except Exception as e:  # e.g. out of memory: the case fails, the others still run
                    traceback.print_exc()
                    why = f"{type(e).__name__}: {str(e)[:300]}"
                    ck.piece(case.id, "setup", "Step", lambda: None, lambda: None, lambda: dict(ok=False, note=why))
                    continue
                if ck.wants("step"):
                    check_step(ck, st)
                if ck.wants("v2-slots"):
                    check_v2_slots(ck, st)
                for whole in (True, False):
                    if ck.wants("attn-whole" if whole else "attn-rows"):
                        check_target_attention(ck, st, whole, attn_paths(dev, triton_mode))
                if ck.wants("draft"):
                    check_draft(ck, st, attn_paths(dev, triton_mode))
                if ck.wants("compact-kernel") and triton_mode:
                    check_compaction(ck, st, True, triton_mode)
                if ck.wants("compact-copies"):
                    check_compaction(ck, st, False, "copy_kv_slots")
                if any(ck.wants(f"sampler-{m}") for m in ("greedy", "topk1", "topp")):
                    data = SamplerData(st)
                    for mode in ("greedy", "topk1", "topp"):
                        if ck.wants(f"sampler-{mode}"):
                            check_sampler(ck, st, mode, data)
                del st
            if dev.type == "cuda" and ck.wants("sampler-128k"):
                # the tree sampler's memory at B=64 and a 128k vocabulary (Llama 3): logits of 64 x 119 rows
                case = Case("falcon-llama", 64, "bfloat16", 8, 1, 64, 16, "LBNHC")
                st = Step(case, ns, dev, 1, 600, 128256, all_full=True)
                data = SamplerData(st)
                for mode in ("greedy", "topp"):
                    check_sampler(ck, st, mode, data, piece=f"sampler-128k-{mode}")
                del st, data
            if ck.wants("chain-graph"):
                import chain_graph

                chain_graph.check(ck, dev, a.quick, cuda_ms)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.set_num_threads(threads)
        vllm_desc = ("vLLM's own (KV views: create_kv_cache_views, compared with the stand-in arithmetic)" if ns.real
                     else "stand-ins (--stub-vllm)" if a.stub_vllm else "stand-ins (vLLM not importable)")
    device = (torch.cuda.get_device_name() if dev.type == "cuda"
              else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    rows = ck.rows
    failed = [r for r in rows if not r["ok"]]
    res = dict(device=device, torch=torch.__version__, triton=triton_v, triton_mode=triton_mode, vllm=vllm_desc,
               command=("TRITON_INTERPRET=1 " if os.environ.get("TRITON_INTERPRET") == "1" else "")
               + "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               grid="quick" if a.quick else "full", cases=len(cases), checks=len(rows), failed=len(failed),
               seconds=time.time() - t0, skipped=skipped, summary=summary(rows), rows=rows)
    name = a.name or "gpu_check_" + ("".join(c if c.isalnum() else "_" for c in device.lower()) if dev.type == "cuda"
                                      else "cpu")
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, name + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out_dir, name + ".md"), "w") as f:
        f.write(to_markdown(res))
    print()
    for x in res["summary"]:
        print(f"{x['piece']:19s} {x['path']:26s} {x['checks']:4d} checks {x['failed']:3d} failed  max err "
              f"{fmt(x['max_err']):8s} max syncs {fmt(x['max_syncs']):4s} max peak MiB {fmt(x['max_peak_MiB']):7s} "
              f"median ms {fmt(x['median_ms'])}")
    print(f"\n{device}: {len(cases)} cases, {len(rows)} checks, {len(failed)} failed, {res['seconds']:.0f} s; "
          f"vLLM objects: {vllm_desc}")
    for s in skipped:
        print("skipped:", s)
    for r in failed:
        print("FAILED:", r["case"], r["piece"], r["path"], r["note"], file=sys.stderr)
    print(f"wrote {os.path.join(a.out_dir, name)}.json and .md")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    args = parser().parse_args()
    if args.device == "cpu" and "falcon_vllm.kernels.tree_attention" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # this process only: the kernels run interpreted on CPU
    sys.exit(main())
