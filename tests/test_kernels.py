"""Triton kernels against their torch references (CPU: TRITON_INTERPRET=1), and the references
against a dense masked softmax."""

import os
from types import SimpleNamespace

import pytest
import torch

# The interpreter must be chosen before triton launches anything, and it must not leak into the
# vLLM tests of the same process: `make test` runs this file in its own process with it set.
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 on CPU (make test does)", allow_module_level=True)

from falcon_vllm.kernels.kv_compaction import (kv_compaction, kv_compaction_ref,  # noqa: E402
                                               plane_table, vllm_planes)
from falcon_vllm.kernels.tree_attention import (ancestor_mask_from_parents, batch_tree_bits,  # noqa: E402
                                                causal_tree_bits, pack_mask_rows, pack_tree_mask, tree_attention,
                                                tree_attention_ref, tree_bits_from_parents,
                                                tree_bits_from_tree, unpack_tree_bits)
from falcon_vllm.tree import build_tree, DecodingTree  # noqa: E402

torch.set_num_threads(1)
# The kernels run on the GPU when there is one, else through the interpreter on CPU tensors.
DEV = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")


def _random_tree(n, seed):
    g = torch.Generator().manual_seed(seed)
    paths = [[0]]
    while len(paths) < n:
        p = paths[int(torch.randint(len(paths), (1,), generator=g))]
        child = p + [int(torch.randint(4, (1,), generator=g))]
        if child not in paths:
            paths.append(child)
    return DecodingTree(paths, 1)


def _case(prefix_lens, trees, Hq, Hkv, D, dtype, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(prefix_lens)
    Ws = [t.num_slots for t in trees]
    T = sum(Ws)
    nblk = [max(1, (p + bs - 1) // bs) for p in prefix_lens]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g)  # scattered physical blocks
    bt = torch.zeros(B, max(nblk), dtype=torch.int32)
    c = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[c:c + n].int()
        c += n
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q, k, v = r(T, Hq, D), r(T, Hkv, D), r(T, Hkv, D)
    kc, vc = r(num_blocks, bs, Hkv, D), r(num_blocks, bs, Hkv, D)
    qsl = torch.tensor([0] + list(torch.tensor(Ws).cumsum(0)), dtype=torch.int32)
    bits = batch_tree_bits(trees)
    return tuple(t.to(DEV) for t in (q, k, v, kc, vc, bt, torch.tensor(prefix_lens, dtype=torch.int32), qsl, bits))


def _dense(q, k, v, kc, vc, bt, pl, qsl, trees, scale):
    """Naive dense computation on CPU: gather, build the full mask, softmax."""
    q, k, v, kc, vc, bt, pl, qsl = (t.cpu() for t in (q, k, v, kc, vc, bt, pl, qsl))
    outs = []
    bs = kc.shape[1]
    for b, t in enumerate(trees):
        s, e, P = int(qsl[b]), int(qsl[b + 1]), int(pl[b])
        slots = [int(bt[b, p // bs]) * bs + p % bs for p in range(P)]
        kp = kc.reshape(-1, *kc.shape[2:])[slots]
        vp = vc.reshape(-1, *vc.shape[2:])[slots]
        K = torch.cat([kp, k[s:e]]).float()
        Vv = torch.cat([vp, v[s:e]]).float()
        rep = q.shape[1] // k.shape[1]
        K, Vv = K.repeat_interleave(rep, 1), Vv.repeat_interleave(rep, 1)
        mask = torch.cat([torch.ones(e - s, P, dtype=torch.bool), t.ancestor_mask], 1)
        att = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].float().transpose(0, 1), K.transpose(0, 1), Vv.transpose(0, 1), attn_mask=mask, scale=scale)
        outs.append(att.transpose(0, 1))
    return torch.cat(outs)


GRID = [
    # prefix lens, trees, Hq, Hkv, D, dtype, block size
    ([0], [build_tree("chain-5", 1)], 2, 2, 64, torch.float32, 16),
    ([1, 16], [build_tree("tree-2x2", 1), _random_tree(7, 1)], 3, 1, 64, torch.float32, 16),
    ([37, 5, 32], [_random_tree(9, 2), build_tree("chain-3", 1), _random_tree(12, 3)], 4, 2, 128, torch.float32, 16),
    ([20], [build_tree("falcon-llama", 2)], 2, 1, 64, torch.float32, 16),
    ([33, 0], [_random_tree(40, 4), build_tree("tree-3x2", 1)], 2, 2, 64, torch.float16, 16),
    ([17], [_random_tree(10, 5)], 2, 1, 64, torch.bfloat16, 16),
    ([23, 10, 0, 5], [_random_tree(6, 6), build_tree("chain-2", 1), _random_tree(3, 7), build_tree("chain-1", 1)],
     8, 2, 64, torch.float32, 5),                                      # block size 5, GQA 4, B=4
    ([70], [build_tree("falcon-vicuna", 2)], 1, 1, 64, torch.float32, 16),  # 165 nodes: 6 mask words
]


@pytest.mark.parametrize("prefix_lens,trees,Hq,Hkv,D,dtype,bs", GRID)
def test_tree_attention_matches_reference(prefix_lens, trees, Hq, Hkv, D, dtype, bs):
    args = _case(prefix_lens, trees, Hq, Hkv, D, dtype, bs=bs)
    scale = D ** -0.5
    ref = tree_attention_ref(*args, scale=scale)
    dense = _dense(*args[:-1], trees, scale)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ref.float().cpu(), dense, **tol)
    out = tree_attention(*args, scale=scale)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("num_splits", [2, 3])
def test_tree_attention_split_prefix(num_splits, fuse, balance):
    """Split-KV over the prefix (partials merged by the last split to arrive, or by the combine kernel; the
    in-flight keys in the last split or shared among the splits), including a split left empty (P=0) and a
    request whose in-flight keys span several splits; twice in a row, so the fused merge's counters must reset."""
    trees = [build_tree("tree-2x2", 1), _random_tree(5, 8), build_tree("chain-3", 1), _random_tree(70, 12)]
    args = _case([45, 0, 130, 20], trees, 4, 2, 64, torch.float32, bs=16, seed=3)
    ref = tree_attention_ref(*args, scale=0.125)
    for _ in range(2):
        out = tree_attention(*args, scale=0.125, num_splits=num_splits,
                             config={"fuse_combine": fuse, "balance": balance})
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("partials", ["half", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_attention_half_partials(dtype, partials):
    """Split partials stored in q's dtype (normalised, so in range) or fp32, two query tiles, poisoned output."""
    trees = [_random_tree(24, 10), build_tree("tree-3x2", 1)]
    args = _case([150, 77], trees, 4, 2, 64, dtype, bs=16, seed=5)
    ref = tree_attention_ref(*args, scale=0.125)
    buf = torch.full_like(args[0], float("nan"))
    out = tree_attention(*args, scale=0.125, num_splits=4, out=buf,
                         config={"partials": partials, "block_m": 16, "block_n": 16})
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_tree_attention_small_tiles_and_out_buffer():
    """Several query tiles per request (block_m below W x group) and an explicit output buffer."""
    trees = [_random_tree(13, 9)]
    args = _case([9], trees, 4, 2, 64, torch.float32, bs=4, seed=4)
    ref = tree_attention_ref(*args, scale=0.125)
    buf = torch.full_like(args[0], float("nan"))  # poisoned: every element must be written
    out = tree_attention(*args, scale=0.125, out=buf, config={"block_m": 16, "block_n": 16})
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _sar_case(passes, k, Hq, Hkv, D, dtype, prefix_lens, seed):
    """In-flight keys apart from the queries, as the drafter's tree passes have them: request b has WK_b keys
    (its earlier passes' blocks, then this pass's) and queries its last W_b = blocks x k; a query row sees
    a random subset of the earlier keys and its whole own block of k rows.  Returns the kernel's arguments
    (kv_start_loc last) and the same problem with every in-flight key also a query row (square masks)."""
    g = torch.Generator().manual_seed(seed)
    q, k_, v, bits, full_q, full_bits, qsl, ksl = [], [], [], [], [], [], [0], [0]
    for hist_blocks, nb in passes:
        nh, nq = hist_blocks * k, nb * k
        own = torch.rand(nq, nh, generator=g) < 0.5
        own = torch.cat([own, torch.zeros(nq, nq, dtype=torch.bool)], 1)
        for i in range(nq):
            own[i, nh + i // k * k: nh + (i // k + 1) * k] = True
        full = torch.eye(nh + nq, dtype=torch.bool)
        full[nh:] = own
        words = (nh + nq + 31) // 32
        bits.append(pack_mask_rows(own, words))
        full_bits.append(pack_mask_rows(full, words))
        qq = torch.randn(nq, Hq, D, generator=g).to(dtype)
        q.append(qq)
        full_q.append(torch.cat([torch.randn(nh, Hq, D, generator=g).to(dtype), qq]))
        k_.append(torch.randn(nh + nq, Hkv, D, generator=g).to(dtype))
        v.append(torch.randn(nh + nq, Hkv, D, generator=g).to(dtype))
        qsl.append(qsl[-1] + nq)
        ksl.append(ksl[-1] + nh + nq)
    words = max(b.shape[1] for b in bits)
    pad = lambda b: torch.nn.functional.pad(b, (0, words - b.shape[1]))  # noqa: E731
    base = _case(prefix_lens, [build_tree("chain-1", 1)] * len(passes), Hq, Hkv, D, dtype, seed=seed)
    kc, vc, bt, pl = base[3:7]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    cat = lambda xs: torch.cat(xs).to(DEV)  # noqa: E731
    ksl_t = i32(ksl)
    args = (cat(q), cat(k_), cat(v), kc, vc, bt, pl, i32(qsl), cat([pad(b) for b in bits]))
    full = (cat(full_q), cat(k_), cat(v), kc, vc, bt, pl, ksl_t, cat([pad(b) for b in full_bits]))
    return args, ksl_t, full, ksl


@pytest.mark.parametrize("k,Hq,Hkv,block_m,num_splits", [(2, 4, 2, None, None), (2, 3, 1, 16, None),
                                                          (3, 2, 2, 16, 2), (2, 7, 1, None, 3)])
def test_tree_attention_queries_apart_from_their_keys(k, Hq, Hkv, block_m, num_splits):
    """The drafter's SAR tree passes: queries are the last rows of each request's in-flight keys (kv_start_loc)
    and see their own block whole (group=k), also where a query tile ends inside a block (tiles of 5, 9 and 16
    tokens) and across mask words (a pass of 20 blocks after 30 earlier ones).  The reference equals the
    square problem's rows; the kernel equals the reference."""
    passes = [(0, 3), (16, 8), (30, 20)]
    args, ksl, full, kstarts = _sar_case(passes, k, Hq, Hkv, 64, torch.float32, [21, 0, 70], seed=k + Hq)
    ref = tree_attention_ref(*args, scale=0.125, kv_start_loc=ksl)
    square = tree_attention_ref(*full, scale=0.125)
    rows = torch.cat([torch.arange(kstarts[b] + h * k, kstarts[b + 1]) for b, (h, _) in enumerate(passes)])
    torch.testing.assert_close(ref, square[rows.to(DEV)], rtol=1e-5, atol=1e-5)
    config = {"block_m": block_m, "block_n": 16} if block_m else None
    out = tree_attention(*args, scale=0.125, kv_start_loc=ksl, group=k, num_splits=num_splits, config=config)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if k == 3:  # without the group, a tile ending inside a block at a mask word's end misses the block's later
        # rows: request 1's first tile ends at key 24 + 8 = 32 (for k dividing 32 no word boundary cuts a block)
        wrong = tree_attention(*args, scale=0.125, kv_start_loc=ksl, num_splits=num_splits, config=config)
        assert not torch.allclose(wrong, ref, rtol=1e-4, atol=1e-4)


def test_tree_bits_helpers():
    tree = build_tree("falcon-llama", 2)
    W = tree.num_slots
    bits = tree_bits_from_tree(tree)
    assert bits.dtype == torch.int32 and bits.shape == (W, (W + 31) // 32)
    assert torch.equal(unpack_tree_bits(bits, W), tree.ancestor_mask)
    assert torch.equal(ancestor_mask_from_parents(tree.parent), tree.ancestor_mask)
    assert torch.equal(tree_bits_from_parents(tree.parent), bits)
    assert torch.equal(unpack_tree_bits(causal_tree_bits(40), 40), torch.ones(40, 40, dtype=torch.bool).tril())
    chain = build_tree("chain-4", 1)
    both = batch_tree_bits([tree, chain.parent])              # a tree and a parent list, padded words
    assert both.shape == (W + chain.num_slots, bits.shape[1])
    assert torch.equal(unpack_tree_bits(both[W:], chain.num_slots), chain.ancestor_mask)
    bit31 = pack_tree_mask(torch.ones(32, 32, dtype=torch.bool).tril())  # the sign bit of an int32 word
    assert int(bit31[31, 0]) == -1
    with pytest.raises(ValueError, match="j <= i"):
        pack_tree_mask(torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="itself"):
        pack_tree_mask(torch.zeros(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="parent"):
        ancestor_mask_from_parents(torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError, match="words"):
        pack_tree_mask(torch.ones(40, 40, dtype=torch.bool).tril(), num_words=1)


def _compaction_case(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    caches = torch.randn(3, 2, 4, 8, 2, 64, generator=g).to(dtype)   # 3 layers x (K, V), 4 blocks of 8
    # request 1: prefix ends at slot 9; accepted nodes at 11, 12, 15 -> 10, 11, 12 (dst 11 is a src)
    # request 2 (blocks 2-3): accepted 20, 23 -> 18, 19;  a pair with src == dst is a no-op
    src = torch.tensor([11, 12, 15, 20, 23, 27])
    dst = torch.tensor([10, 11, 12, 18, 19, 27])
    want = caches.clone().view(3, 2, 32, 2, 64)
    orig = want.clone()
    for s_, d in zip(src.tolist(), dst.tolist()):
        want[:, :, d] = orig[:, :, s_]
    return caches, src, dst, want.view_as(caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_compaction_overlapping_multi_layer(dtype):
    caches, src, dst, want = _compaction_case(dtype)
    ref = caches.clone()
    kv_compaction_ref(ref.flatten(0, 1), src, dst)              # stacked planes [6, blocks, bs, H, D]
    assert torch.equal(ref, want)
    # vLLM 0.32 FLASH_ATTN layer caches: logical [blocks, H, bs, 2 D] over NHD memory (LBNHC)
    layers = [torch.cat([c[0], c[1]], -1).to(DEV).transpose(1, 2) for c in caches]
    kv_compaction(vllm_planes(layers), src.to(DEV), dst.to(DEV))
    got = torch.stack([torch.stack(kv.transpose(1, 2).split(64, -1)) for kv in layers])
    assert torch.equal(got.cpu(), want)


def test_kv_compaction_rows_with_counts():
    """[B, A] pairs with per-request counts (padding ignored) and a prebuilt pointer table."""
    caches, src, dst, want = _compaction_case()
    rows_src = torch.tensor([[11, 12, 15, 0], [20, 23, 27, 0]])
    rows_dst = torch.tensor([[10, 11, 12, 1], [18, 19, 27, 2]])  # the 4th column is padding
    counts = torch.tensor([3, 3])
    ref = caches.clone()
    kv_compaction_ref(list(ref.flatten(0, 1).unbind(0)), rows_src, rows_dst, counts)
    assert torch.equal(ref, want)
    tri = caches.clone().to(DEV)
    table = plane_table(list(tri.flatten(0, 1).unbind(0)))
    kv_compaction(table, rows_src.to(DEV), rows_dst.to(DEV), counts.to(DEV), block_p=2)  # several chunks per row
    assert torch.equal(tri.cpu(), want)
    with pytest.raises(ValueError, match="counts"):
        kv_compaction_ref(ref.flatten(0, 1), rows_src, rows_dst)
    with pytest.raises(ValueError, match="same shape"):
        plane_table([caches[0, 0], caches[0, 0, :2]])


def test_tree_mode_compaction_through_the_kernel(monkeypatch):
    """vLLM tree mode's compaction (falcon_vllm.vllm.tree_verify.compact_kv) on FLASH_ATTN-layout layer caches
    goes through one kv_compaction launch for all layers (on CUDA by default; forced here) and moves what
    the per-layer index copies move.  The plane pointer table is built once and reused."""
    pytest.importorskip("vllm")
    import falcon_vllm.kernels.kv_compaction as kvc
    from falcon_vllm.vllm import tree_verify

    caches, src, dst, want = _compaction_case()                 # [2, blocks, bs, H, D] per layer

    def to_flash(c):  # vLLM 0.32's FLASH_ATTN layer cache: the logical [blocks, H, bs, 2D] view
        return torch.cat([c[0], c[1]], -1).transpose(1, 2)

    def from_flash(kv):  # K and V as FlashAttention reads them
        return torch.stack(kv.transpose(1, 2).split(kv.shape[-1] // 2, dim=-1))

    launches = []
    monkeypatch.setattr(kvc, "kv_compaction", lambda *a, **kw: launches.append(a) or kv_compaction(*a, **kw))
    layers = [to_flash(c).to(DEV) for c in caches]
    holder = SimpleNamespace(plane_table=None)    # the tree state keeps the pointer table
    for _ in range(2):
        for c, layer in zip(caches, layers):
            layer.copy_(to_flash(c))
        tree_verify.compact_kv([(kv, "flash") for kv in layers], src.to(DEV), dst.to(DEV), state=holder, kernel=True)
        assert torch.equal(torch.stack([from_flash(kv) for kv in layers]).cpu(), want)
    assert len(launches) == 2 and launches[0][0] is launches[1][0]       # one launch per step, table reused
    loop = [to_flash(c) for c in caches]
    tree_verify.compact_kv([(kv, "flash") for kv in loop], src, dst, kernel=False)
    assert torch.equal(torch.stack([from_flash(kv) for kv in loop]), want) and len(launches) == 2


class FlashAttentionImpl:  # tree mode reads the class name (the FLASH_ATTN layout) and the scale
    scale = 64 ** -0.5


@pytest.mark.parametrize("Hq,Hkv,dtype", [(4, 2, torch.float32), (3, 3, torch.float16)])
def test_drafter_tree_passes_through_the_kernel(monkeypatch, Hq, Hkv, dtype):
    """vLLM tree mode's drafter passes (DraftTreeAttention) on FLASH_ATTN-layout caches: through the Triton kernel
    (CUDA's path; forced here) they give what the dense path gives, pass after pass (falcon-llama's three SAR
    tree passes, three requests with prefixes off block multiples), and never gather the prefix."""
    pytest.importorskip("vllm")
    from falcon_vllm.core import tree_draft

    tree, D, bs = build_tree("falcon-llama", 2), 64, 16
    k, B = tree.k, 3
    g = torch.Generator().manual_seed(7)
    plens = torch.tensor([37, 5, 64], device=DEV)
    nblk = [(int(p) + bs - 1) // bs for p in plens]
    table = torch.zeros(B, max(nblk), dtype=torch.int32)
    perm = torch.randperm(sum(nblk) + 2, generator=g)
    for b, c in enumerate(torch.tensor([0] + nblk).cumsum(0)[:-1].tolist()):
        table[b, :nblk[b]] = perm[c:c + nblk[b]].int()
    kv = torch.randn(sum(nblk) + 2, Hkv, bs, 2 * D, generator=g).to(dtype).to(DEV)   # vLLM's logical view
    layer = SimpleNamespace(layer_name="drafter.layers.0.attn")
    passes = [tree.passes[p].ancestor_blocks for p in range(1, tree.num_passes)]
    inputs = [tuple(torch.randn(B * c.shape[0] * k, h, D, generator=g).to(dtype).to(DEV) for h in (Hq, Hkv, Hkv))
              for c in passes]
    outs = {}
    for path in ("kernel", "dense"):
        fn = tree_attention if path == "kernel" else None
        monkeypatch.setattr(tree_draft, "_draft_kernel", lambda q, layout, fn=fn: fn)
        att = tree_draft.DraftTreeAttention(table.to(DEV), plens, k)
        outs[path] = []
        for chain, (q, kk, vv) in zip(passes, inputs):
            att.begin_pass(chain)
            out = torch.zeros(q.shape[0], Hq * D, dtype=dtype, device=DEV)
            att.attend(FlashAttentionImpl(), layer, q, kk, vv, kv, None, out)
            outs[path].append(out)
        assert (att._prefix == {}) == (path == "kernel")               # the kernel reads the prefix in place
    assert len(passes) == 3
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(outs["kernel"], outs["dense"]):
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tree_attention_on_gpu():
    args = [a.cuda() for a in _case([2048], [build_tree("falcon-llama", 2)], 32, 32, 128, torch.float16)]
    ref = tree_attention_ref(*[a.cpu() for a in args], scale=128 ** -0.5)
    torch.testing.assert_close(tree_attention(*args, scale=128 ** -0.5).cpu().float(), ref.float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [{"fuse_combine": True}, {"fuse_combine": False}, {"balance": True},
                                    {"fuse_combine": True, "block_m": 128, "num_warps": 8}])
def test_tree_attention_split_merge_is_race_free_on_gpu(config):
    """The fused merge (arrival counters across programs) must give the same bits on every launch: a moving
    result would be a race.  7B heads, prefix 2048, W=128 (the batch-1 goal shape), 16 splits, 300 launches."""
    args = [a.cuda() for a in _case([2048], [_random_tree(128, 11)], 32, 32, 128, torch.float16, seed=6)]
    ref = tree_attention_ref(*[a.cpu() for a in args], scale=128 ** -0.5).float()
    first = tree_attention(*args, scale=128 ** -0.5, num_splits=16, config=config)
    torch.testing.assert_close(first.cpu().float(), ref, rtol=2e-2, atol=2e-2)
    outs = [tree_attention(*args, scale=128 ** -0.5, num_splits=16, config=config) for _ in range(300)]
    assert all(torch.equal(o, first) for o in outs)


def test_bench_kernels_smoke(tmp_path):
    """The kernel benchmark script runs end to end (tiny shapes; on CPU through the interpreter)."""
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import bench_kernels

    if torch.cuda.is_available():
        argv = ["--heads", "gqa8", "--width", "8", "--prefix", "64", "--batch", "1", "--name", "k"]
    else:
        argv = ["--smoke", "--name", "k"]
    assert bench_kernels.main(argv + ["--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "k.json").read_text())
    assert res["tree_attention"] and res["kv_compaction"]
    for r in res["tree_attention"]:
        assert r["tree_ms"] > 0 and r["sdpa_ms"] > 0 and r["max_abs_err_vs_ref"] < 2e-2
    assert (tmp_path / "k.md").read_text().startswith("# Kernel benchmark")


def test_profile_tree_attention_smoke(tmp_path):
    """The batch-1 merge-variant benchmark runs end to end (tiny shapes; on CPU through the interpreter): every
    merge variant computes the reference's result."""
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import profile_tree_attention

    if torch.cuda.is_available():
        pytest.skip("the GPU run is the benchmark itself (minutes)")
    assert profile_tree_attention.main(["--smoke", "--name", "v", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "v.json").read_text())
    rows = [r for s in res["shapes"] for r in s["rows"]]
    assert {r["merge"] for r in rows} == set(profile_tree_attention.MERGES)
    assert all(r["max_abs_err"] < 1e-4 and r["ms"] > 0 and r["sdpa_ms"] > 0 for r in rows)
