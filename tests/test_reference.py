"""Losslessness of the reference engine: greedy token equality with transformers' generate,
full acceptance with an exact drafter, and a statistical test of sampling."""

import itertools

import pytest
import torch

from falcon_vllm.reference import FalconReferenceEngine
from falcon_vllm.testing import exact_drafter, hf_greedy, increment_llama, random_drafter, tiny_llama
from falcon_vllm.verify import probs_from_logits

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 2, 99, 17, 64, 23, 8, 8, 120, 31, 77]]
CASES = [("falcon-llama", 2), ("falcon-vicuna", 2), ("chain-6", 2), ("eagle-small", 1), ("chain-5", 3),
         ("tree-3x2x2x1x1", 3)]


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def qwen():
    return tiny_llama(qwen2=True, seed=3)


@pytest.mark.parametrize("tree,k", CASES)
def test_greedy_equals_hf_generate_random_drafter(llama, tree, k):
    eng = FalconReferenceEngine(llama, random_drafter(llama, k=k, fusion="lstm" if k != 3 else "fc"), tree)
    for p in PROMPTS:
        assert eng.generate(p, 40).tokens == hf_greedy(llama, p, 40)


@pytest.mark.parametrize("tree,k", [("falcon-llama", 2), ("chain-4", 3)])
def test_greedy_equals_hf_generate_qwen2(qwen, tree, k):
    eng = FalconReferenceEngine(qwen, random_drafter(qwen, k=k, num_layers=2), tree)
    for p in PROMPTS[:2]:
        assert eng.generate(p, 32).tokens == hf_greedy(qwen, p, 32)


@pytest.mark.parametrize("tree,k", CASES)
def test_exact_drafter_accepts_everything(tree, k):
    tgt = increment_llama()
    eng = FalconReferenceEngine(tgt, exact_drafter(tgt, k=k), tree)
    r = eng.generate([5, 6, 7], 50)
    assert r.tokens == hf_greedy(tgt, [5, 6, 7], 50) == [(7 + i) % 128 for i in range(1, 51)]
    depth = eng.tree.max_depth
    assert all(a == depth for a in r.accept_lengths)            # every drafted level accepted
    assert all(x.drafter_passes == -(-depth // k) for x in r.rounds)
    assert r.tau == depth + 1


def test_eos_and_max_tokens(llama):
    eng = FalconReferenceEngine(llama, random_drafter(llama), "chain-4")
    ref = hf_greedy(llama, PROMPTS[0], 30)
    eos = ref[10]
    out = eng.generate(PROMPTS[0], 30, eos_token_id=eos).tokens
    assert out == ref[: ref.index(eos) + 1]
    with pytest.raises(ValueError, match="exceeds the target's context"):
        eng.generate(PROMPTS[0], 5000)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.generate([], 5)


# ---------------------------------------------------------------- sampling losslessness
def _exact_continuation_dist(model, prompt, L, temperature, top_p):
    """Exact distribution of the next L tokens under the processed target distribution."""
    V = model.config.vocab_size
    dist = {}
    frontier = {(): 1.0}
    with torch.inference_mode():
        for _ in range(L):
            nxt = {}
            seqs = list(frontier)
            logits = model(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1]
            probs = probs_from_logits(logits.float(), temperature, None, top_p)
            for s, p in zip(seqs, probs):
                for v in torch.nonzero(p > 1e-9).flatten().tolist():
                    nxt[s + (v,)] = frontier[s] * float(p[v])
            frontier = nxt
    dist = frontier
    return dist, V


def _tv(samples, dist):
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    keys = set(counts) | set(dist)
    return 0.5 * sum(abs(counts.get(x, 0) / n - dist.get(x, 0.0)) for x in keys)


def _null_threshold(dist, n, trials=20, seed=0):
    """The largest TV among `trials` exact samplers of size n (drawn from `dist` itself), x 1.25."""
    g = torch.Generator().manual_seed(seed)
    keys = list(dist)
    p = torch.tensor([dist[x] for x in keys])
    worst = max(_tv([keys[i] for i in torch.multinomial(p, n, True, generator=g).tolist()], dist)
                for _ in range(trials))
    return 1.25 * worst


def _no_residual_verify(tree, node_tokens, target_logits, temperature, top_k=None, top_p=None, generator=None):
    """A deliberately WRONG verifier: after rejecting drafts it samples from the unmodified p."""
    from falcon_vllm.verify import VerifyResult
    probs = probs_from_logits(target_logits[0], torch.full((target_logits.shape[1],), temperature), None,
                              torch.full((target_logits.shape[1],), top_p or 1.0))
    u, path = 0, []
    while True:
        for c in tree.children[u]:
            if float(torch.rand((), generator=generator)) < float(probs[u, int(node_tokens[0, c - 1])]):
                path.append(c)
                u = c
                break
        else:
            bonus = int(torch.multinomial(probs[u], 1, generator=generator))
            return VerifyResult([path], torch.tensor([bonus]), torch.tensor([len(path)]))


@pytest.mark.parametrize("temperature,top_p", [(1.0, None), (0.7, 0.9)])
def test_sampling_is_lossless_statistically(temperature, top_p, monkeypatch):
    """Empirical distribution of 3-token continuations converges to the target's exact one,
    and the same test rejects a verifier that skips the residual distribution."""
    tgt = tiny_llama(vocab=6, hidden=32, heads=2, kv_heads=1, inter=64, seed=7)
    with torch.no_grad():
        tgt.lm_head.weight.mul_(0.5)  # flatter target: many continuations have real mass
    eng = FalconReferenceEngine(tgt, random_drafter(tgt, k=2, seed=2), "tree-3x2x1")
    prompt, L, n = [1, 4, 2], 3, 1200
    dist, _ = _exact_continuation_dist(tgt, prompt, L, temperature, top_p)
    samples = [tuple(eng.generate(prompt, L, temperature=temperature, top_p=top_p, seed=s).tokens)
               for s in range(n)]
    tv_small, tv_large = _tv(samples[:300], dist), _tv(samples, dist)
    assert tv_large < _null_threshold(dist, n), tv_large
    assert tv_large < tv_small  # converges as samples grow
    import falcon_vllm.reference as ref
    monkeypatch.setattr(ref, "sample_verify", _no_residual_verify)
    wrong = [tuple(eng.generate(prompt, L, temperature=temperature, top_p=top_p, seed=s).tokens)
             for s in range(n)]
    assert _tv(wrong, dist) > _null_threshold(dist, n), _tv(wrong, dist)
