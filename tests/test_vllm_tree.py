"""falcon in vLLM, tree mode (CPU, in-process engine, eager, fp32).

Targets as in test_vllm_chain.py: ``rnd`` (a random tiny Llama: attention matters, so a wrong
mask, position or compaction changes the output) and ``inc`` (the sharpened increment model with
exact drafters), and ``ctx`` (falcon_vllm.testing.context_llama: the increment model whose
distribution depends on the whole context) for the sampling tests.  One engine lives at a time; each is built once per module.
"""

import math
import random

import pytest
import torch

from tests.vllm_util import (EngineCache, context_chi_square, counter_delta, drafter_of, greedy as _greedy,
                             reference_drafts, runner_of, save_target, seeded, spec_counters, structured)

from falcon_vllm.testing import (context_llama, exact_drafter, increment_llama, random_drafter, tiny_llama,
                                 truncate_head)
from falcon_vllm.tree import build_tree
from falcon_vllm.acceptance import best_tree

V = 49152
SHARP = 1000.0
PROMPTS = [[11, 12, 13], list(range(200, 237)), [5] * 9, list(range(1000, 1020)), [7, 8],
           list(range(3000, 3050)), [42] * 4, list(range(500, 517))]                     # 8 mixed lengths


def _tuned_tree(n: int = 40) -> list[list[int]]:
    """A tree fitted by tune-tree's optimiser to a synthetic rank profile (40 nodes)."""
    rng = random.Random(0)
    profiles = [tuple(min(3, int(rng.expovariate(1.5))) for _ in range(rng.randint(0, 7))) for _ in range(400)]
    return best_tree(profiles, n)[0]


def _tuned_file(path) -> str:
    """A tune-tree output: 40 nodes at batch 1-2, 12 at batch 3-5, no speculation from batch 6."""
    import json

    by = {"1": {"paths": _tuned_tree(40)}, "3": {"paths": _tuned_tree(12)}, "6": {"paths": []}}
    path.write_text(json.dumps({"paths": _tuned_tree(40), "k": 3, "by_batch_size": by}))
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("tree")
    rnd = tiny_llama(vocab=V, hidden=64, heads=2, kv_heads=1, seed=5)
    save_target(rnd, str(base / "rnd"))
    random_drafter(rnd, k=2, fusion="lstm").save_pretrained(str(base / "rnd_k2"))
    random_drafter(rnd, k=2, fusion="fc", seed=8, block_order="reversed", level_embedding=True).save_pretrained(
        str(base / "rnd_k2_rev"))
    random_drafter(rnd, k=3, fusion="fc", num_layers=2, seed=4).save_pretrained(str(base / "rnd_k3"))
    _tuned_file(base / "tuned.json")
    inc = increment_llama(vocab=V, hidden=128, heads=2, kv_heads=1)
    with torch.no_grad():
        inc.lm_head.weight.mul_(SHARP)
    save_target(inc, str(base / "inc"))
    exact_drafter(inc, k=2).save_pretrained(str(base / "exact_k2"))
    # its head over a shuffled half of the vocabulary (a d2t map, as a drafter with --draft-vocab stores one)
    half = torch.randperm(V, generator=torch.Generator().manual_seed(2))[: V // 2]
    truncate_head(exact_drafter(inc, k=2), inc, half).save_pretrained(str(base / "exact_k2_half"))
    ctx = context_llama(vocab=V)
    save_target(ctx, str(base / "ctx"))
    return {"dir": base, "rnd": rnd, "inc": inc, "ctx": ctx}


def _engine_specs(base) -> dict:
    """name -> (target dir, speculative config, LLM kwargs)."""
    spec = lambda model, tree: {"method": "falcon", "model": str(base / model), "tree": tree}  # noqa: E731
    specs = {
        "vanilla": ("rnd", None, {}),
        "llama": ("rnd", spec("rnd_k2", "falcon-llama"), {}),
        "llama_rev": ("rnd", spec("rnd_k2_rev", "falcon-llama"), {}),
        "vicuna": ("rnd", spec("rnd_k2", "falcon-vicuna"), {}),
        "tuned_k3": ("rnd", spec("rnd_k3", str(base / "tuned.json")), {}),
        "oracle": ("rnd", spec("rnd_k2", "falcon-llama"), {"enable_prefix_caching": True, "block_size": 32}),
        "small_kv": ("rnd", spec("rnd_k2", "tree-3x2x2x1"), {"num_gpu_blocks_override": 8, "block_size": 32,
                                                              "max_model_len": 192, "max_num_seqs": 4}),
        "exact": ("inc", spec("exact_k2", "tree-3x2x1x1x1x1"), {"per_request_spec_decode_metrics": "detailed"}),
        "ctx": ("ctx", spec("exact_k2", "tree-3x2x1x1x1x1"), {}),
        # the shipped Qwen2.5-Coder-1.5B drafter's shape of serving: a truncated head, a one-level tree of 4
        "ctx_half": ("ctx", spec("exact_k2_half", [[0], [1], [2], [3]]), {}),
    }
    return {name: (str(base / target), sc, kw) for name, (target, sc, kw) in specs.items()}


@pytest.fixture(scope="module")
def engines(ckpts):
    e = EngineCache(_engine_specs(ckpts["dir"]))
    yield e
    e.close()


def _logprobs(llm, prompts, n=16):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=3), use_tqdm=False)
    return [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]


def test_vanilla_reference(engines, ckpts):
    llm = engines.get("vanilla")
    ckpts["vanilla"] = {tuple(p): t for p, t in zip(PROMPTS, _greedy(llm, PROMPTS, n=64)[0])}
    ckpts["vanilla_logprobs"] = _logprobs(llm, PROMPTS[:3])
    ckpts["vanilla_seeded"] = seeded(llm, PROMPTS)


@pytest.mark.parametrize("name,nodes", [("llama", 118), ("vicuna", 165), ("tuned_k3", 40)])
def test_random_drafter_greedy_identical_to_vanilla(engines, ckpts, name, nodes):
    ref = ckpts.get("vanilla")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    llm = engines.get(name)
    prop = drafter_of(llm)
    assert prop.tree is not None and prop.tree.num_nodes == nodes
    sizes, orig = [], prop._draft_tree
    prop._draft_tree = lambda cad, rows, pos, K: sizes.append((rows.shape[0], K)) or orig(cad, rows, pos, K)
    before = spec_counters(llm)
    try:
        for p in PROMPTS[:2]:                                               # batch 1
            assert _greedy(llm, [p])[0][0] == ref[tuple(p)][:40], p
        got, _ = _greedy(llm, PROMPTS)                                      # batch 8, mixed lengths
        got3, _ = _greedy(llm, PROMPTS[:3])                                 # batch 3
    finally:
        del prop._draft_tree
    assert got == [ref[tuple(p)][:40] for p in PROMPTS]
    assert got3 == [ref[tuple(p)][:40] for p in PROMPTS[:3]]
    d = counter_delta(spec_counters(llm), before)
    assert d["num_drafts"] > 0
    if name == "tuned_k3":  # the tune-tree file shrinks the tree as the batch grows
        assert {(1, 40), (3, 12)} <= set(sizes) and all(B < 6 for B, _ in sizes)
        assert prop.skipped_steps > 0  # batch 8 drafts nothing: the runner's fast path skipped drafting
        assert 12 * d["num_drafts"] < d["num_draft_tokens"] < 40 * d["num_drafts"]
    else:
        assert {K for _, K in sizes} == {nodes} and d["num_draft_tokens"] == nodes * d["num_drafts"]
        assert prop.passes == prop.steps * prop.tree.num_passes            # counted per step


def test_no_drafts_step_is_a_vanilla_step(engines, ckpts, monkeypatch):
    """A step that verifies nothing (tuned_k3 at batch 8: its schedule drafts nothing) samples with vLLM's plain
    sampler, as a vanilla step does: neither the tree sampler nor the rejection sampler runs, and seeded random
    sampling returns vanilla's exact tokens."""
    from falcon_vllm.vllm import tree_verify

    ref = ckpts.get("vanilla_seeded")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    llm = engines.get("tuned_k3")
    runner = runner_of(llm)
    calls = []
    tree_sample, rejection = tree_verify.tree_sample, runner.rejection_sampler
    monkeypatch.setattr(tree_verify, "tree_sample", lambda *a, **k: calls.append("tree") or tree_sample(*a, **k))
    monkeypatch.setattr(runner, "rejection_sampler", lambda *a, **k: calls.append("rej") or rejection(*a, **k))
    skipped = drafter_of(llm).skipped_steps
    assert seeded(llm, PROMPTS) == ref
    assert calls == [] and drafter_of(llm).skipped_steps > skipped
    from vllm import SamplingParams

    # batch 1 drafts a 40-node tree: the tree sampler serves an unseeded sampled request
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=12, temperature=0.9), use_tqdm=False)
    assert "tree" in calls


def test_schedule_near_max_model_len(engines):
    """tuned_k3 drafts 12 nodes at batch 3 and 40 at batch 1.  A request within 40 tokens of max_model_len makes
    vLLM skip the drafter (it hands the scheduler 40 zero tokens per request); when its batch-mates finish in such a
    step, the scheduler widened those zeros to 40 nodes against the 12-node tree drafted last: the step crashed
    pairing 40 rows with 12 depths.  Now such steps verify no drafts, and the outputs are vanilla's."""
    from vllm import SamplingParams

    long = [(31 * i) % 20000 + 100 for i in range(470)]                 # 470 + 42 = max_model_len 512
    prompts = [{"prompt_token_ids": long}, {"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": PROMPTS[3]}]
    params = [SamplingParams(max_tokens=42, temperature=0, ignore_eos=True)] + [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5)]

    def run(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    want = run(engines.get("vanilla"))
    llm = engines.get("tuned_k3")
    before = spec_counters(llm)
    assert run(llm) == want
    d = counter_delta(spec_counters(llm), before)
    assert d["num_drafts"] > 0 and d["num_draft_tokens"] < 40 * d["num_drafts"]  # the step at batch 3 drafted 12


@pytest.mark.parametrize("name", ["llama", "tuned_k3"])
def test_seeded_requests_do_not_depend_on_their_batch_mates(engines, ckpts, name):
    """vLLM gives a seeded request the same tokens whatever it is batched with.  Tree mode serves seeded sampled
    requests without drafts: alone, beside others and in vanilla's batch of 8 they give vanilla's tokens.  Before,
    their trees (whose width follows the batch size) and vLLM's sampler over every root row drew from their
    generators."""
    ref = ckpts.get("vanilla_seeded")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    llm = engines.get(name)
    assert seeded(llm, PROMPTS[:1]) == ref[:1]
    assert seeded(llm, PROMPTS[:3]) == ref[:3]
    assert seeded(llm, PROMPTS) == ref


def test_structured_output_matches_vanilla(engines):
    """A choice, a JSON schema and a regex, greedy, beside an unconstrained request that drafts trees: vanilla's
    tokens (structured requests are sampled by vLLM's own sampler, without drafts)."""
    want = structured(engines.get("vanilla"))
    llm = engines.get("llama")
    before = spec_counters(llm)
    assert structured(llm) == want
    assert counter_delta(spec_counters(llm), before)["num_drafts"] > 0


def _set_logprobs_mode(llm, mode):
    runner = runner_of(llm)
    runner.sampler.logprobs_mode = runner.sampler.topk_topp_sampler.logprobs_mode = mode


def test_logprobs_modes_and_given_token_ids_match_vanilla(engines, ckpts):
    """Tree steps honour the engine's ``logprobs_mode`` as vLLM's sampler does (they always returned raw
    logprobs), and a request asking only for given token ids gets them (it got None)."""
    from vllm import SamplingParams

    from falcon_vllm.verify import probs_from_logits

    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    given = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprob_token_ids=[5, 77, 300])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]

    def run(llm, mode, params):
        _set_logprobs_mode(llm, mode)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            _set_logprobs_mode(llm, "raw_logprobs")
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]

    vanilla = engines.get("vanilla")
    want = {mode: run(vanilla, mode, greedy) for mode in ("raw_logits", "processed_logprobs")}
    want_given = run(vanilla, "raw_logprobs", given)
    llm = engines.get("llama")
    for mode, ref in want.items():
        for (toks, lps), (rtoks, rlps) in zip(run(llm, mode, greedy), ref):
            assert toks == rtoks and len(lps) == len(rlps) == 12
            for g, r in zip(lps, rlps):
                assert set(g) == set(r) and all(abs(g[t].logprob - r[t].logprob) < 1e-3 for t in r), (mode, g, r)
    for (toks, lps), (rtoks, rlps) in zip(run(llm, "raw_logprobs", given), want_given):
        assert toks == rtoks and lps is not None and len(lps) == 12
        for g, r in zip(lps, rlps):
            assert set(g) == set(r) and all(abs(g[t].logprob - r[t].logprob) < 1e-3 for t in r)
    # processed logprobs of sampled tree steps: the target's distribution after temperature and top-k
    sampled = SamplingParams(max_tokens=12, temperature=0.7, top_k=5, ignore_eos=True, logprobs=6)
    before = spec_counters(llm)
    for prompt, (toks, lps) in zip(PROMPTS[:3], run(llm, "processed_logprobs", sampled)):
        assert counter_delta(spec_counters(llm), before)["num_drafts"] > 0
        with torch.no_grad():
            logits = ckpts["rnd"](torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1:]
        probs = probs_from_logits(logits, 0.7, 5)
        for j, (t, step) in enumerate(zip(toks, lps)):
            finite = [v.logprob for v in step.values() if v.logprob > -1e30]
            assert len(finite) == 5 and abs(sum(math.exp(x) for x in finite) - 1) < 1e-3, step
            assert abs(step[t].logprob - math.log(float(probs[j, t]))) < 1e-3


def test_logprobs_match_vanilla(engines, ckpts):
    """Tree steps return the target's logprobs of every emitted token and its top-3, as vanilla does."""
    ref = ckpts.get("vanilla_logprobs")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    got = _logprobs(engines.get("llama"), PROMPTS[:3])
    for g, r in zip(got, ref):
        assert len(g) == len(r) == 16
        for gs, rs in zip(g, r):
            assert set(gs) == set(rs)
            assert all(abs(gs[t] - rs[t]) < 1e-4 for t in rs), (gs, rs)


@pytest.mark.parametrize("name,batch", [("llama", [1]), ("llama", [1, 3, 7]), ("llama_rev", [1, 3, 7])])
def test_tree_drafts_match_reference_engine(engines, ckpts, name, batch):
    """vLLM's SAR tree drafting (paged prefix + step-local ancestor blocks, one batched attention call per
    drafter pass over all requests and blocks) equals the reference engine's, request by request (the
    paper's block order, and the reversed one with a level embedding; 1-layer drafters: see the proposer's
    docstring)."""
    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.reference import FalconReferenceEngine

    llm = engines.get(name)
    prop = drafter_of(llm)
    log, orig = {}, prop.propose

    def propose(*a, **kw):
        out = orig(*a, **kw)
        for rid, row in zip(prop._runner.input_batch.req_ids, out.tolist()):
            log.setdefault(rid, []).append(row)
        return out

    prompts = [PROMPTS[i] for i in batch]
    prop.propose = propose
    try:
        tokens, outs = _greedy(llm, prompts, n=16)
    finally:
        del prop.propose
    drafter = FalconDrafter.from_pretrained(str(ckpts["dir"] / ("rnd_k2_rev" if name == "llama_rev" else "rnd_k2")))
    for p, toks, o in zip(prompts, tokens, outs):
        eng = FalconReferenceEngine(ckpts["rnd"], drafter, tree="falcon-llama")
        ref_tokens, ref_drafts = reference_drafts(eng, p, 16)
        assert ref_tokens == toks
        ours = [v for rid, v in log.items() if rid.rsplit("-", 1)[0] == o.request_id]  # internal id: external-xxx
        assert len(ours) == 1
        ours = ours[0]
        n = min(len(ours), len(ref_drafts)) - 1
        assert n >= 10 and ours[:n] == ref_drafts[:n], p


def _oracle(prop, truth: dict, path):
    """Make the proposer put the target's true continuation on tree path ``path`` (wrong tokens elsewhere)."""
    orig = prop._draft_tree
    batch = prop._runner.input_batch
    slots = [prop.tree.slot_of(path[:d]) for d in range(1, len(path) + 1)]

    def draft_tree(cad, rows, positions, K):
        out = orig(cad, rows, positions, K)
        for i in range(out.shape[0]):
            seq = batch.token_ids_cpu[i, : int(batch.num_tokens_no_spec[i])].tolist()
            full = next((f for f in truth.values() if f[: len(seq)] == seq), None)
            if full is None:
                continue
            root = int(positions[i, -1]) + 1                                 # index of the pending token
            out[i] = (full[root] + 2 + torch.arange(out.shape[1])) % V      # never the target's argmax
            for s, t in zip(slots, full[root + 1: root + 1 + len(slots)]):
                out[i, s - 1] = t
        return out

    prop._draft_tree = draft_tree


def test_compaction_with_accepted_off_consecutive_paths(engines, ckpts):
    """Drafts that are right along the rank-1 path ([1], [1,0], ...): accepted nodes are never in
    consecutive slots, so every step compacts the target K/V.  On a random target any wrong K/V,
    position or mask changes the output; the prefix cache must hold exactly a fresh prefill's K/V."""
    ref = ckpts.get("vanilla")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    llm = engines.get("oracle")
    prop = drafter_of(llm)
    truth = {tuple(p): list(p) + ref[tuple(p)] for p in PROMPTS}
    _oracle(prop, truth, [1] + [0] * 7)
    before = spec_counters(llm)
    try:
        got, _ = _greedy(llm, PROMPTS, n=56)
    finally:
        del prop._draft_tree
    assert got == [ref[tuple(p)][:56] for p in PROMPTS]
    d = counter_delta(spec_counters(llm), before)
    assert d["num_accepted_tokens"] / d["num_drafts"] > 5                     # deep paths were accepted
    # resubmit prompt + output: the full blocks come from the prefix cache written by tree steps
    seqs = [list(p) + ref[tuple(p)][:56] for p in PROMPTS[1:2] + PROMPTS[5:6]]
    hits0 = {m.name: m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits"}
    again, _ = _greedy(llm, [s[:-8] for s in seqs], n=8)
    hits1 = {m.name: m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits"}
    assert again == [s[-8:] for s in seqs]
    assert "vllm:prefix_cache_hits" in hits0 and "vllm:prefix_cache_hits" in hits1
    assert hits1["vllm:prefix_cache_hits"] - hits0["vllm:prefix_cache_hits"] >= 64


def test_preemption_and_abort_lose_nothing(engines, ckpts):
    """8 KV blocks of 32 slots for 4 requests of ~100 tokens with 27-node trees: requests are preempted
    and resumed mid-generation; one request is aborted between tree steps.  The survivors are
    token-identical to vanilla."""
    from vllm import SamplingParams

    ref = ckpts.get("vanilla")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    llm = engines.get("small_kv")
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[5], PROMPTS[7]]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
        if steps == 6:
            eng.abort_request(["r2"])
    assert "r2" not in done and set(done) == {"r0", "r1", "r3"}
    for i in (0, 1, 3):
        assert done[f"r{i}"] == ref[tuple(prompts[i])][:48], i
    preempted = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    assert preempted > 0


INC_PROMPTS = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106], [9000, 9001, 9002]]


def test_exact_drafter_accepts_full_depth(engines):
    llm = engines.get("exact")
    prop = drafter_of(llm)
    depth = prop.tree.max_depth
    before, steps0, passes0 = spec_counters(llm), prop.steps, prop.passes
    toks, outs = _greedy(llm, INC_PROMPTS, n=36)
    for p, t in zip(INC_PROMPTS, toks):
        assert t == [(p[-1] + i) % V for i in range(1, 37)]
    c = counter_delta(spec_counters(llm), before)
    assert c["num_drafts"] > 0 and c["num_accepted_tokens"] == depth * c["num_drafts"]
    assert c["num_accepted_tokens_per_pos"][:depth] == [c["num_drafts"]] * depth   # per depth
    for o in outs:
        assert o.outputs[0].spec_decode_metrics.to_dict()["mean_acceptance_length"] == depth + 1
    steps = prop.steps - steps0
    assert steps > 0 and prop.passes - passes0 == steps * math.ceil(depth / prop.k)
    assert prop.tree_state.accepted_per_depth[-1] == prop.tree_state.steps > 0


def _sample_chi_square(llm, ckpts, temperature, top_k, top_p, n=64):
    """Sample 16 tokens after ``n`` random prompts on the context target -> (chi-square, counts,
    expected, spec counter delta)."""
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(n)]
    kw = {k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None}
    before = spec_counters(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=temperature, ignore_eos=True, **kw),
                        use_tqdm=False)
    chi2, counts, expected = context_chi_square(ckpts["ctx"], prompts, outs, temperature, top_k, top_p)
    return chi2, counts, expected, counter_delta(spec_counters(llm), before)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, None, 0.9), (1.0, 3, None)])
def test_sampling_is_lossless(engines, ckpts, temperature, top_k, top_p):
    """Every generated token's bin (d = -2..2, other) against the context target's processed
    distribution given its actual prefix; the tree has 3 candidates at depth 1, so rejected siblings
    and residual distributions are exercised."""
    chi2, counts, expected, c = _sample_chi_square(engines.get("ctx"), ckpts, temperature, top_k, top_p)
    assert chi2 < 23.0, (counts.tolist(), expected.tolist())  # chi-square, <= 5 dof, p ~ 3e-4
    assert 0 < c["num_accepted_tokens"] < c["num_drafts"] * 6               # accepted and rejected


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, None, 0.9), (1.0, None, None)])
def test_sampling_is_lossless_with_a_truncated_head(engines, ckpts, temperature, top_k, top_p):
    """A drafter whose head covers half the vocabulary (its d2t map), serving a one-level tree of its top-4 first
    tokens: the tokens it cannot draft come from the residual, and the output still follows the target."""
    chi2, counts, expected, c = _sample_chi_square(engines.get("ctx_half"), ckpts, temperature, top_k, top_p)
    assert chi2 < 23.0, (counts.tolist(), expected.tolist())  # chi-square, <= 5 dof, p ~ 3e-4
    assert 0 < c["num_accepted_tokens"] < c["num_drafts"]      # accepted and rejected (one token a draft)


def test_broken_verifier_is_caught(engines, ckpts, monkeypatch):
    """The test above can fail: a tree verifier that accepts under the target sharpened to
    temperature 0.5 instead of the request's 1.0 is rejected by the same statistic (on twice the
    prompts: at 64 its chi-square sits near the threshold, about 23, and float rounding decides)."""
    from falcon_vllm.vllm import tree_verify

    orig = tree_verify.sample_verify
    monkeypatch.setattr(tree_verify, "sample_verify", lambda tree, nodes, lg, t, *a, **kw: orig(tree, nodes, lg, t / 2,
                                                                                                *a, **kw))
    chi2, counts, expected, _ = _sample_chi_square(engines.get("ctx"), ckpts, 1.0, None, None, n=128)
    assert chi2 >= 23.0, (chi2, counts.tolist(), expected.tolist())  # the threshold above


def test_tree_config_errors(ckpts):
    from falcon_vllm.vllm.options import MAX_TREE_NODES, resolve_falcon_config

    hf = ckpts["rnd"].config
    d = str(ckpts["dir"] / "rnd_k2")
    sc, info = resolve_falcon_config({"model": d, "tree": "falcon-llama"}, hf, {"model", "num_speculative_tokens"})
    assert info.mode == "tree" and sc["num_speculative_tokens"] == 118 and len(info.tree) == 118
    sc, info = resolve_falcon_config({"model": d, "tree": "chain-6"}, hf, {"model", "num_speculative_tokens"})
    assert info.mode == "chain" and sc["num_speculative_tokens"] == 6
    with pytest.raises(ValueError, match="disagrees"):
        resolve_falcon_config({"model": d, "tree": "falcon-llama", "num_speculative_tokens": 5}, hf,
                              {"model", "num_speculative_tokens"})
    big = [[i] for i in range(MAX_TREE_NODES + 1)]
    with pytest.raises(ValueError, match="at most"):
        resolve_falcon_config({"model": d, "tree": big}, hf, {"model", "num_speculative_tokens"})
    with pytest.raises(ValueError, match="128"):
        resolve_falcon_config({"model": d, "num_speculative_tokens": 200}, hf, {"model", "num_speculative_tokens"})
    with pytest.raises(ValueError, match="orphan|no parent"):
        resolve_falcon_config({"model": d, "tree": [[0], [1, 0, 0]]}, hf, {"model", "num_speculative_tokens"})
    assert build_tree(_tuned_tree(), 3).num_nodes == 40


@pytest.mark.parametrize("block_size,head_dim", [(32, 32), (16, 64)])  # vec and vec16 ISAs
def test_cpu_paged_layout_and_slot_copy(block_size, head_dim):
    """paged_kv reads back what CPU_ATTN's cache writer stored (keys transposed per block), and
    copy_kv_slots moves exactly the K/V of the given slots."""
    from vllm import _custom_ops as ops

    from falcon_vllm.core.paged_kv import copy_kv_slots, paged_kv

    nb, hkv, T = 4, 2, 9
    kv = torch.zeros(nb, hkv, block_size, 2 * head_dim)
    kc4, vc4 = kv.view(nb, hkv, 2 * block_size, head_dim).chunk(2, dim=2)
    key, value = torch.randn(T, hkv, head_dim), torch.randn(T, hkv, head_dim)
    slots = torch.tensor([0, 1, 5, block_size, block_size + 3, 2 * block_size + 1, 3 * block_size - 1, 7, 9])
    isa = "vec" if block_size % 32 == 0 else "vec16"
    ops.cpu_attn_reshape_and_cache(key, value, kc4, vc4, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    kc, vc = paged_kv(kv, "cpu")
    assert kc.shape == vc.shape == (nb, block_size, hkv, head_dim)
    assert torch.equal(kc[slots // block_size, slots % block_size], key)
    assert torch.equal(vc[slots // block_size, slots % block_size], value)
    before = kv.clone()
    copy_kv_slots(kv, "cpu", slots[[3, 5]], torch.tensor([2, 3]))
    assert torch.equal(kc[0, 2], key[3]) and torch.equal(vc[0, 3], value[5])
    changed = (kv != before).any(-1)                       # [nb, hkv, bs]: rows of the raw layout
    assert int(changed.sum()) > 0
    kc_b, vc_b = paged_kv(before, "cpu")
    keep = torch.ones(nb, block_size, dtype=torch.bool)
    keep[0, 2] = keep[0, 3] = False
    assert torch.equal(kc[keep], kc_b[keep]) and torch.equal(vc[keep], vc_b[keep])


def test_tune_tree_file_becomes_a_batch_size_schedule(ckpts, tmp_path):
    from falcon_vllm.vllm.options import resolve_falcon_config

    f = _tuned_file(tmp_path / "t.json")
    valid = {"model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size"}
    sc, info = resolve_falcon_config({"model": str(ckpts["dir"] / "rnd_k3"), "tree": f}, ckpts["rnd"].config, valid)
    assert sc["num_speculative_tokens"] == 40 and info.mode == "tree"
    assert sc["num_speculative_tokens_per_batch_size"] == [[1, 2, 40], [3, 5, 12], [6, 1 << 20, 0]]
    assert sorted(map(int, info.subtrees)) == [12, 40]
    # a fit that found speculation unprofitable everywhere: tree mode with K = 0 at every batch size
    import json
    none = tmp_path / "none.json"
    none.write_text(json.dumps({"paths": [[0]], "by_batch_size": {"1": {"paths": []}, "8": {"paths": []}}}))
    sc, info = resolve_falcon_config({"model": str(ckpts["dir"] / "rnd_k3"), "tree": str(none)}, ckpts["rnd"].config,
                                     valid)
    assert info.mode == "tree" and sc["num_speculative_tokens_per_batch_size"] == [[1, 7, 0], [8, 1 << 20, 0]]
