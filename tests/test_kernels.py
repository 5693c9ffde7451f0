"""Triton kernels against their torch references (CPU: TRITON_INTERPRET=1), and the references
against a dense masked softmax."""

import os

import pytest
import torch

# The interpreter must be chosen before triton launches anything, and it must not leak into the
# vLLM tests of the same process: `make test` runs this file in its own process with it set.
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 on CPU (make test does)", allow_module_level=True)

from falcon_vllm.kernels.kv_compaction import kv_compaction, kv_compaction_ref  # noqa: E402
from falcon_vllm.kernels.tree_attention import (bits_for_batch, tree_attention,  # noqa: E402
                                                tree_attention_ref)
from falcon_vllm.tree import build_tree, DecodingTree  # noqa: E402

torch.set_num_threads(1)


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
    bits = bits_for_batch([t.ancestor_mask for t in trees])
    return q, k, v, kc, vc, bt, torch.tensor(prefix_lens, dtype=torch.int32), qsl, bits


def _dense(q, k, v, kc, vc, bt, pl, qsl, trees, scale):
    """Naive dense computation: gather, build the full mask, softmax."""
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
    # prefix lens, trees, Hq, Hkv, D, dtype
    ([0], [build_tree("chain-5", 1)], 2, 2, 64, torch.float32),
    ([1, 16], [build_tree("tree-2x2", 1), _random_tree(7, 1)], 3, 1, 64, torch.float32),
    ([37, 5, 32], [_random_tree(9, 2), build_tree("chain-3", 1), _random_tree(12, 3)], 4, 2, 128, torch.float32),
    ([20], [build_tree("falcon-llama", 2)], 2, 1, 64, torch.float32),
    ([33, 0], [_random_tree(40, 4), build_tree("tree-3x2", 1)], 2, 2, 64, torch.float16),
    ([17], [_random_tree(10, 5)], 2, 1, 64, torch.bfloat16),
]


@pytest.mark.parametrize("prefix_lens,trees,Hq,Hkv,D,dtype", GRID)
def test_tree_attention_matches_reference(prefix_lens, trees, Hq, Hkv, D, dtype):
    args = _case(prefix_lens, trees, Hq, Hkv, D, dtype)
    scale = D ** -0.5
    ref = tree_attention_ref(*args, scale=scale)
    dense = _dense(*args[:-1], trees, scale)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ref.float(), dense, **tol)
    out = tree_attention(*args, scale=scale)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_kv_compaction_overlapping_multi_layer():
    g = torch.Generator().manual_seed(0)
    caches = torch.randn(3, 4, 8, 2, 64, generator=g)   # 3 layers, 4 blocks of 8 slots
    # request 1: prefix ends at slot 9; accepted nodes at 11, 12, 15 -> 10, 11, 12 (dst 11 is a src)
    # request 2 (blocks 2-3): accepted 20, 23 -> 18, 19
    src = torch.tensor([11, 12, 15, 20, 23])
    dst = torch.tensor([10, 11, 12, 18, 19])
    want = caches.clone().view(3, 32, 2, 64)
    orig = want.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        want[:, d] = orig[:, s]
    ref = caches.clone()
    kv_compaction_ref(ref, src, dst)
    torch.testing.assert_close(ref.view(3, 32, 2, 64), want)
    tri = caches.clone()
    kv_compaction(tri, src, dst)
    torch.testing.assert_close(tri, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tree_attention_on_gpu():
    args = [a.cuda() for a in _case([2048], [build_tree("falcon-llama", 2)], 32, 32, 128, torch.float16)]
    ref = tree_attention_ref(*[a.cpu() for a in args], scale=128 ** -0.5)
    torch.testing.assert_close(tree_attention(*args, scale=128 ** -0.5).cpu().float(), ref.float(),
                               rtol=2e-2, atol=2e-2)
