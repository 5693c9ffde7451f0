"""Tree mode on vLLM 0.32's paged KV caches, built by vLLM's own layout code (CPU, no engine).

Each layer's cache is made as vLLM's allocator makes it (``compute_layout_strides`` +
``create_kv_cache_views``: the logical [num_blocks, Hkv, block_size, 2 D] view with the strides of
a ``KVCacheLayout``), filled the way the backend stores K/V (CPU_ATTN: vLLM's own
``cpu_attn_reshape_and_cache`` op; FLASH_ATTN, whose CUDA writer cannot run here: its documented
layout, K then V along the last dim), and then every reader and writer of tree mode is checked
against a dense fp32 oracle: target tree attention, the slot copies of the compaction, the
drafter's tree pass and ``kernels.kv_compaction``.
"""

import pytest
import torch

from falcon_vllm.kernels.kv_compaction import kv_compaction_ref, vllm_planes
from falcon_vllm.kernels.tree_attention import ancestor_mask_from_parents, pack_tree_mask

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, compute_layout_strides,  # noqa: E402
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from falcon_vllm.core import paged_kv, tree_draft  # noqa: E402
from falcon_vllm.vllm import tree_verify  # noqa: E402

L, NB, HKV, HQ = 2, 6, 2, 4
CASES = [("flash", lay, 16, 64) for lay in KVCacheLayout] + [("cpu", KVCacheLayout.LBHNC, 32, 32),
                                                              ("cpu", KVCacheLayout.LBHNC, 16, 64)]
IDS = [f"{b}-{lay.name}-bs{bs}-d{d}" for b, lay, bs, d in CASES]


def _impl(backend: str, d: int):
    """A real vLLM attention impl of the backend (tree mode reads its class and scale)."""
    if backend == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as cls
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl as cls
    impl = cls.__new__(cls)  # __init__ probes the device's kernels; tree mode needs only these fields
    impl.scale, impl.head_size, impl.num_kv_heads = d ** -0.5, d, HKV
    return impl


class _Layer:
    def __init__(self, name, isa):
        self.layer_name, self.isa = name, isa


def _caches(layout, bs, d):
    """L layer caches of one KV-cache tensor, as vLLM's allocator views them."""
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=HKV, head_size=d, dtype=torch.float32)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NB, L, layout)
    t = KVCacheTensor(size=L * NB * spec.page_size_bytes, layers=[f"l{i}" for i in range(L)],
                      layer_stride=layer_stride, block_stride=block_stride)
    return create_kv_cache_views(torch.zeros(t.size, dtype=torch.int8), spec, NB, layout, t)


def _store(backend, kv, key, value, slots, bs, d):
    if backend == "cpu":  # exactly what CPUAttentionBackendImpl.do_kv_cache_update calls
        from vllm import _custom_ops as ops

        kc, vc = kv.view(NB, HKV, bs * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, "vec" if bs % 32 == 0 else "vec16",
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    else:             # FLASH_ATTN: [block, head, offset, K | V]
        for t, s in enumerate(slots.tolist()):
            kv[s // bs, :, s % bs, :d] = key[t]
            kv[s // bs, :, s % bs, d:] = value[t]


@pytest.fixture(params=CASES, ids=IDS)
def case(request):
    backend, layout, bs, d = request.param
    g = torch.Generator().manual_seed(0)
    caches = _caches(layout, bs, d)
    assert caches[0].shape == (NB, HKV, bs, 2 * d)
    # two requests: block tables [3, 1, ...] and [4, 0, 5]; prefixes of 20 and 2*bs+3 tokens
    table = torch.tensor([[3, 1, 2], [4, 0, 5]], dtype=torch.int32)
    plens = [20, 2 * bs + 3]
    dense = []  # per layer, per request: (K [P, Hkv, D], V)
    for kv in caches:
        per = []
        for r, P in enumerate(plens):
            k, v = torch.randn(P, HKV, d, generator=g), torch.randn(P, HKV, d, generator=g)
            pos = torch.arange(P)
            slots = table[r].long()[pos // bs] * bs + pos % bs
            _store(backend, kv, k, v, slots, bs, d)
            per.append((k, v))
        dense.append(per)
    return dict(backend=backend, layout=paged_kv.kv_layout(_impl(backend, d), _Layer("l0", "vec")),
                impl=_impl(backend, d), caches=caches, table=table, plens=plens, dense=dense, bs=bs, d=d, g=g)


def _sdpa(q, k, v, mask, scale):
    """Dense fp32 attention: q [W, Hq, D], k/v [T, Hkv, D], mask [W, T]."""
    o = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1), attn_mask=mask,
        scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def test_paged_kv_reads_what_the_backend_stored(case):
    bs = case["bs"]
    for kv, per in zip(case["caches"], case["dense"]):
        kc, vc = paged_kv.paged_kv(kv, case["layout"])
        assert kc.shape == vc.shape == (NB, bs, HKV, case["d"])
        for r, (k, v) in enumerate(per):
            pos = torch.arange(len(k))
            blk = case["table"][r].long()[pos // bs]
            assert torch.equal(kc[blk, pos % bs], k) and torch.equal(vc[blk, pos % bs], v)


def test_verify_tree_attention_matches_dense_oracle(case):
    """VerifyTreeAttention (the target's tree rows) over the paged prefix + in-flight tree tokens."""
    d, g, impl = case["d"], case["g"], case["impl"]
    parents = [torch.tensor([-1, 0, 0, 1, 2, 3]), torch.tensor([-1, 0, 1, 1])]   # root first
    W = [len(p) for p in parents]
    qsl = [0, W[0], W[0] + W[1]]
    bits = torch.cat([pack_tree_mask(ancestor_mask_from_parents(p), 1) for p in parents])
    n = qsl[-1] + 3                                     # 3 rows of a request without a tree at the end
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (HQ, HKV, HKV))

    class MD:  # what VerifyTreeAttention reads of the backend's metadata
        seq_lens = torch.tensor([case["plens"][0] + W[0], case["plens"][1] + W[1]], dtype=torch.int32)
        block_table = case["table"]
        max_seq_len = int(seq_lens.max())

    # whole=False: a batch whose other rows (here a request without a tree) keep the stock kernel's output
    att = tree_verify.VerifyTreeAttention(list(range(qsl[-1])), [0, 1], qsl, bits, "cpu", whole=False)
    kv = case["caches"][0]
    out = torch.full((n, HQ * d), 7.0)
    att.attend(impl, _Layer("l0", "vec"), q, k, v, kv, MD, out)
    out = out.view(n, HQ, d)
    for r in range(2):
        pk, pv = case["dense"][0][r]
        s, e, P = qsl[r], qsl[r + 1], case["plens"][r]
        mask = torch.cat([torch.ones(W[r], P, dtype=torch.bool), ancestor_mask_from_parents(parents[r])], 1)
        want = _sdpa(q[s:e], torch.cat([pk, k[s:e]]), torch.cat([pv, v[s:e]]), mask, impl.scale)
        torch.testing.assert_close(out[s:e].double(), want, atol=1e-5, rtol=1e-5)
    assert bool((out[qsl[-1]:] == 7.0).all())           # rows outside the trees untouched


@pytest.mark.parametrize("sdpa_min_rows", [tree_verify.SDPA_MIN_ROWS, 1], ids=["matmuls", "sdpa"])
def test_verify_tree_attention_whole_batch_on_cpu(case, sdpa_min_rows, monkeypatch):
    """The CPU whole-batch path (the stock kernel skipped): a tree request and a request without a tree
    (3 causal rows, padded to the tree's width), both reading this step's K/V from the cache, where the
    backend's own writer put them before attention; then the tree request alone (batch of one).  Both
    branches: batched matmuls (small trees) and PyTorch's fused attention (from SDPA_MIN_ROWS rows)."""
    monkeypatch.setattr(tree_verify, "SDPA_MIN_ROWS", sdpa_min_rows)
    if case["backend"] != "cpu":
        pytest.skip("the whole-batch path of a CUDA tensor is the Triton kernel (tests/test_kernels.py)")
    d, g, impl, bs, kv = case["d"], case["g"], case["impl"], case["bs"], case["caches"][0]
    masks = [ancestor_mask_from_parents(torch.tensor([-1, 0, 0, 1, 2, 3])), torch.ones(3, 3, dtype=torch.bool).tril()]
    W = [len(m) for m in masks]
    q, k, v = (torch.randn(sum(W), h, d, generator=g) for h in (HQ, HKV, HKV))
    qsl = [0, W[0], W[0] + W[1]]
    for r in range(2):  # the step's K/V go to the slots right after each prefix
        pos = case["plens"][r] + torch.arange(W[r])
        slots = case["table"][r].long()[pos // bs] * bs + pos % bs
        _store("cpu", kv, k[qsl[r]:qsl[r + 1]], v[qsl[r]:qsl[r + 1]], slots, bs, d)

    def want(r):
        pk, pv = case["dense"][0][r]
        s, e, P = qsl[r], qsl[r + 1], case["plens"][r]
        mask = torch.cat([torch.ones(W[r], P, dtype=torch.bool), masks[r]], 1)
        return _sdpa(q[s:e], torch.cat([pk, k[s:e]]), torch.cat([pv, v[s:e]]), mask, impl.scale)

    for reqs in ([0, 1], [0]):
        class MD:
            seq_lens = torch.tensor([case["plens"][r] + W[r] for r in reqs], dtype=torch.int32)
            block_table = case["table"][reqs]
            max_seq_len = int(seq_lens.max())
        bits = torch.cat([pack_tree_mask(masks[r], 1) for r in reqs])
        n = qsl[len(reqs)]
        att = tree_verify.VerifyTreeAttention(None, None, qsl[: len(reqs) + 1], bits, "cpu", whole=True)
        out = torch.full((n + 2, HQ * d), 7.0)          # 2 rows past the batch (vLLM's padding)
        for _ in range(2):                              # the second layer reuses the forward's plan
            att.attend(impl, _Layer("l0", "vec"), q, k, v, kv, MD, out)
        got = out.view(n + 2, HQ, d)
        for r in reqs:
            torch.testing.assert_close(got[qsl[r]:qsl[r + 1]].double(), want(r), atol=1e-5, rtol=1e-5)
        assert bool((got[n:] == 7.0).all())


def test_slot_copies_and_kv_compaction_move_exactly_the_given_slots(case):
    """copy_kv_slots (CPU compaction) and kernels.kv_compaction's vllm_planes (FLASH_ATTN only) move
    the K/V of src slots into dst slots, every head, and nothing else."""
    bs = case["bs"]
    t4 = case["table"][1].long()
    # request 1's accepted nodes at positions 40, 41, 44 -> 38, 39, 40 (a dst is an earlier src)
    pos_src, pos_dst = torch.tensor([40, 41, 44]), torch.tensor([38, 39, 40])
    src, dst = t4[pos_src // bs] * bs + pos_src % bs, t4[pos_dst // bs] * bs + pos_dst % bs
    want = []
    for kv in case["caches"]:
        kc, vc = paged_kv.paged_kv(kv, case["layout"])
        wk, wv = kc.clone(), vc.clone()
        wk[dst // bs, dst % bs], wv[dst // bs, dst % bs] = kc[src // bs, src % bs].clone(), vc[src // bs, src % bs].clone()
        want.append((wk, wv, kv.clone()))
    runs = [lambda: [paged_kv.copy_kv_slots(kv, case["layout"], src, dst) for kv in case["caches"]]]
    if case["backend"] == "flash":
        runs.append(lambda: kv_compaction_ref(vllm_planes(case["caches"]), src, dst))
    for run in runs:
        for kv, (_, _, orig) in zip(case["caches"], want):
            kv.copy_(orig)
        run()
        for kv, (wk, wv, _) in zip(case["caches"], want):
            kc, vc = paged_kv.paged_kv(kv, case["layout"])
            assert torch.equal(kc, wk) and torch.equal(vc, wv)


def test_draft_tree_attention_matches_dense_oracle(case):
    """DraftTreeAttention: two tree passes; block j of pass 2 sees the paged prefix, its ancestor
    block of pass 1 and itself (non-causal)."""
    d, g, impl, k = case["d"], case["g"], case["impl"], 2
    B = 2
    att = tree_draft.DraftTreeAttention(case["table"], torch.tensor(case["plens"]), k)
    layer = _Layer("l1", "vec")
    kv = case["caches"][1]
    hist = []
    for chain in (torch.zeros(2, 0, dtype=torch.long), torch.tensor([[1], [0], [1]])):
        nb = chain.shape[0]
        n = B * nb * k
        q, kk, vv = (torch.randn(n, h, d, generator=g) for h in (HQ, HKV, HKV))
        att.begin_pass(chain)
        out = torch.zeros(n, HQ * d)
        att.attend(impl, layer, q, kk, vv, kv, None, out)
        out = out.view(B, nb, k, HQ, d)
        qs, ks, vs = (x.view(B, nb, k, -1, d) for x in (q, kk, vv))
        for r in range(B):
            pk, pv = case["dense"][1][r]
            for j in range(nb):
                anc = chain[j].tolist()
                keys = torch.cat([pk] + [hist[t][0][r, anc[t]] for t in range(len(hist))] + [ks[r, j]])
                vals = torch.cat([pv] + [hist[t][1][r, anc[t]] for t in range(len(hist))] + [vs[r, j]])
                want = _sdpa(qs[r, j], keys, vals, None, impl.scale)
                torch.testing.assert_close(out[r, j].double(), want, atol=1e-5, rtol=1e-5)
        hist.append((ks, vs))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_to_device_keeps_values_dtypes_and_shapes(device):
    """A step's host indices and tree bits reach the device in one copy (CUDA: one pinned buffer, in their
    common dtype or int64) with every value, dtype and shape kept, int32 extremes included."""
    bits = torch.tensor([[1, -2], [-(2 ** 31), 2 ** 31 - 1]], dtype=torch.int32)
    for host in ([bits, torch.arange(5), torch.tensor([7, 9], dtype=torch.int32)],   # mixed: int64 buffer
                 [bits, torch.tensor([0, 3, 5], dtype=torch.int32)]):                 # one dtype
        moved = paged_kv.to_device(host, device)
        assert len(moved) == len(host)
        for a, b in zip(host, moved):
            assert b.device.type == device and b.dtype == a.dtype and b.shape == a.shape
            assert torch.equal(b.cpu(), a)
