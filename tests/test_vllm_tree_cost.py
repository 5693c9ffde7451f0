"""Tree mode's step-cost pieces in isolation (no engine): the batched drafter attention against the
per-(request, block) computation it replaces, and the tree sampler's bounded memory."""

import pytest
import torch

pytest.importorskip("vllm")

from falcon_vllm.tree import build_tree  # noqa: E402
from falcon_vllm.verify import greedy_verify  # noqa: E402
from falcon_vllm.core import tree_draft  # noqa: E402
from falcon_vllm.vllm import tree_verify  # noqa: E402


class FlashAttentionImplStub:  # kv_layout() reads the class name: FLASH_ATTN's paged layout
    def __init__(self, scale):
        self.scale = scale


class _Layer:
    layer_name = "draft.0.attn"


def _per_block_reference(q, own_k, own_v, hist, chain, pk, pv, scale):
    """The former DraftTreeAttention: one SDPA per (request, block) over cat(prefix, ancestors, own block)."""
    B, nb, k, H, D = q.shape
    out = torch.empty_like(q)
    for r in range(B):
        for j in range(nb):
            anc = chain[j].tolist()
            ks = [pk[r]] + [hist[t][0][r, anc[t]] for t in range(len(hist))] + [own_k[r, j]]
            vs = [pv[r]] + [hist[t][1][r, anc[t]] for t in range(len(hist))] + [own_v[r, j]]
            o = torch.nn.functional.scaled_dot_product_attention(
                q[r, j].transpose(0, 1), torch.cat(ks).transpose(0, 1), torch.cat(vs).transpose(0, 1),
                scale=scale, enable_gqa=True)
            out[r, j] = o.transpose(0, 1)
    return out


def test_batched_draft_tree_attention_equals_per_block_loop():
    """Three tree passes of falcon-llama's shape over a paged prefix of different lengths per request:
    one batched call per pass gives what a loop over (request, block) gives."""
    torch.manual_seed(0)
    k, H, hkv, D, bs = 2, 4, 2, 16, 4
    prefix = torch.tensor([5, 11, 1])
    B = len(prefix)
    nblocks = 12
    kc, vc = torch.randn(nblocks, bs, hkv, D), torch.randn(nblocks, bs, hkv, D)
    kv = torch.cat([kc, vc], -1).transpose(1, 2)                # FLASH_ATTN (vLLM 0.32): [blocks, Hkv, bs, 2D] view
    table = torch.randperm(nblocks)[: B * 3].view(B, 3).to(torch.int32)
    impl, layer = FlashAttentionImplStub(D ** -0.5), _Layer()
    attn = tree_draft.DraftTreeAttention(table, prefix, k, max_prefix=16)
    assert attn.P == 11                                         # CPU: padded to the exact longest prefix
    pk = [kc[table[r].long()].reshape(-1, hkv, D)[: prefix[r]] for r in range(B)]
    pv = [vc[table[r].long()].reshape(-1, hkv, D)[: prefix[r]] for r in range(B)]
    hist, chains = [], []
    for nb, parent in ((1, [0]), (3, [0, 0, 0]), (4, [0, 2, 2, 1])):
        parent = torch.tensor(parent)[:, None]
        chain = torch.cat([chains[-1][parent[:, 0]], parent], 1) if chains else parent[:, :0]
        attn.begin_pass(chain)
        n = B * nb * k
        q, key, val = torch.randn(n, H, D), torch.randn(n, hkv, D), torch.randn(n, hkv, D)
        out = torch.zeros(n, H * D)
        attn.attend(impl, layer, q, key, val, kv, None, out)
        own_k, own_v = key.view(B, nb, k, hkv, D), val.view(B, nb, k, hkv, D)
        ref = _per_block_reference(q.view(B, nb, k, H, D), own_k, own_v, hist, chain, pk, pv, impl.scale)
        torch.testing.assert_close(out.view(B, nb, k, H, D), ref, rtol=1e-5, atol=1e-5)
        hist.append((own_k, own_v))
        chains.append(chain)


def test_sampler_memory_is_bounded_and_chunking_changes_nothing(monkeypatch):
    """Sampling walks chunks of requests whose rows of one depth hold at most SAMPLER_MAX_ELEMS fp32 logits, reading
    the rows from the step's logits in place; greedy reads only the argmax.  Rows with top-k 1 (deterministic) or temperature 0 must then give exactly the greedy
    result, so a chunk that took the wrong rows or parameters would show."""
    torch.manual_seed(1)
    tree = build_tree("tree-2x2x1", 2)
    G, w, V = 7, tree.num_nodes, 5000
    logits = torch.randn(G * (w + 1) + 3, V)
    starts = torch.arange(G) * (w + 1) + 3
    rows = starts[:, None] + torch.arange(w + 1)
    am = logits.argmax(-1)
    parent_rows = starts[:, None] + tree.parent[1:][None]                   # each node's parent slot's row
    nodes = torch.where(torch.rand(G, w) < 0.7, am[parent_rows], torch.randint(0, V, (G, w)))
    want = greedy_verify(tree, nodes, logits[rows])
    assert max(len(a) for a in want.accepted_slots) >= 2                     # deep paths are accepted
    seen = []
    orig = tree_verify.sample_verify
    monkeypatch.setattr(tree_verify, "sample_verify",
                        lambda tr, nd, lg, *a, **kw: seen.append((nd.shape[0], lg is logits)) or orig(tr, nd, lg, *a, **kw))
    budget = 2 * V                                              # two requests per chunk
    temp = torch.tensor([1.0, 0.0, 0.8, 1.0, 0.0, 2.0, 1.0])
    top_k = torch.tensor([1, 0, 1, 1, 5, 1, 1])
    toks, acc = tree_verify.verify_requests(tree, nodes, logits, starts, temp, top_k, None, max_elems=budget)
    assert seen == [(2, True)] * 3 + [(1, True)]                # the logits themselves, never a copy of their rows
    assert acc == want.accepted_slots
    assert toks.tolist() == want.output_token_ids(nodes, width=w + 1).tolist()
    g_toks, g_acc = tree_verify.verify_requests(tree, nodes, logits, starts, argmax=am)
    assert len(seen) == 4 and g_acc == want.accepted_slots and torch.equal(g_toks, toks)
    # no tree (w = 0): one token per request, same bound
    seen.clear()
    one, _ = tree_verify.verify_requests(None, None, logits, starts, temp, top_k, None, max_elems=2 * V)
    assert one[:, 0].tolist() == am[starts].tolist()


def test_compaction_picks_the_kernel_only_for_cuda_flash_caches():
    kv = torch.zeros(2, 4, 8, 1, 16)
    assert not tree_verify._use_compaction_kernel([(kv, "flash")])
    assert not tree_verify._use_compaction_kernel([])


def test_verify_attention_serves_the_whole_batch_like_the_reference():
    """A tree step's target attention, computed once for every row: tree requests under their ancestor mask,
    a request without a tree (a decode row, a short chunk) causally.  The batched CPU path equals the
    per-request torch reference of kernels/tree_attention.py."""
    from types import SimpleNamespace

    from falcon_vllm.kernels.tree_attention import causal_tree_bits, pack_tree_mask, tree_attention_ref

    torch.manual_seed(2)
    H, hkv, D, bs = 4, 2, 16, 4
    trees = [build_tree("tree-2x2x1", 2), None, build_tree("tree-3x2x1", 2), None]
    qlens = [t.num_slots if t is not None else n for t, n in zip(trees, [0, 1, 0, 5])]
    prefix = torch.tensor([7, 3, 12, 0], dtype=torch.int32)
    words = (max(qlens) + 31) // 32
    bits = torch.cat([pack_tree_mask(t.ancestor_mask, words) if t is not None else causal_tree_bits(n, words)
                      for t, n in zip(trees, qlens)])
    qsl = torch.tensor([0] + qlens).cumsum(0).numpy()
    T = int(qsl[-1])
    kc, vc = torch.randn(20, bs, hkv, D), torch.randn(20, bs, hkv, D)
    kv = torch.cat([kc, vc], -1).transpose(1, 2)                # FLASH_ATTN (vLLM 0.32): [blocks, Hkv, bs, 2D] view
    table = torch.randperm(20)[:16].view(4, 4).to(torch.int32)
    md = SimpleNamespace(seq_lens=prefix + torch.tensor(qlens, dtype=torch.int32), block_table=table,
                         max_seq_len=int((prefix + torch.tensor(qlens)).max()))
    attn = tree_verify.VerifyTreeAttention(None, None, qsl, bits, torch.device("cpu"), whole=True)
    q, k, v = torch.randn(T + 3, H, D), torch.randn(T + 3, hkv, D), torch.randn(T + 3, hkv, D)  # + padding rows
    out = torch.full((T + 3, H * D), 7.0)
    attn.attend(FlashAttentionImplStub(0.25), _Layer(), q, k, v, kv, md, out)
    ref = tree_attention_ref(q[:T], k[:T], v[:T], kc, vc, table, prefix, torch.as_tensor(qsl, dtype=torch.int32),
                             bits, 0.25)
    torch.testing.assert_close(out[:T].view(T, H, D), ref, rtol=1e-5, atol=1e-5)
    assert torch.all(out[T:] == 7.0)                                           # padding rows untouched
