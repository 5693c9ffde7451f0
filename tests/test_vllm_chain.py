"""falcon in vLLM, chain mode (CPU, in-process engine, eager, fp32).

Targets (vocab 49152, SmolLM2's tokenizer):
* ``inc``: a sharpened increment model (falcon_vllm.testing.increment_llama with its LM head scaled):
  greedy continuation t+1, t+2, ...; at temperature 1 the next token is t+1+d with d in
  {-2..2} and P(d=0) ~ 0.6, independent of everything but the last token.  The exact drafters
  predict t+1, t+2, ... perfectly.
* ``ctx``: falcon_vllm.testing.context_llama, the same with a small random attention output: the
  distribution of d depends on the whole context.  The sampling tests run on it (with the exact
  drafter of ``inc``, which drafts d = 0 and is accepted or rejected).
* ``rnd``: a random tiny Llama, with random Falcon drafters.

One engine lives at a time (in-process engines share global state); tests are ordered so that
each engine is built once.
"""

import math

import pytest
import torch

from tests.vllm_util import (EngineCache, context_chi_square, counter_delta, drafter_of, greedy as _greedy,
                             reference_drafts, runner_of, save_target, seeded, spec_counters, structured)

from falcon_vllm.testing import (context_llama, exact_drafter, increment_llama, random_drafter, tiny_llama,
                                 truncate_head)

V = 49152
SHARP = 1000.0  # LM-head scale of the increment target: P(next = t+1) ~ 0.6 at temperature 1


def _official_layout(drafter, directory, target):
    """Save a drafter as the official Falcon code does: with a copy of the target's embedding."""
    from safetensors.torch import save_file

    drafter.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in drafter.state_dict().items()}
    state["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    save_file(state, f"{directory}/model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    inc = increment_llama(vocab=V, hidden=128, heads=2, kv_heads=1)
    with torch.no_grad():
        inc.lm_head.weight.mul_(SHARP)
    save_target(inc, str(base / "inc"))
    exact_drafter(inc, k=2).save_pretrained(str(base / "exact_k2"))
    # its head over a shuffled half of the vocabulary (a d2t map that is neither the identity nor sorted)
    half = torch.randperm(V, generator=torch.Generator().manual_seed(2))[: V // 2]
    truncate_head(exact_drafter(inc, k=2), inc, half).save_pretrained(str(base / "exact_k2_half"))
    _official_layout(exact_drafter(inc, k=3), str(base / "exact_k3_official"), inc)
    ctx = context_llama(vocab=V)
    save_target(ctx, str(base / "ctx"))
    rnd = tiny_llama(vocab=V, hidden=64, heads=2, kv_heads=1, seed=5)
    save_target(rnd, str(base / "rnd"))
    random_drafter(rnd, k=3, fusion="lstm").save_pretrained(str(base / "rnd_lstm_k3"))
    random_drafter(rnd, k=3, fusion="fc", seed=6, block_order="reversed", level_embedding=True).save_pretrained(
        str(base / "rnd_fc_k3_rev"))
    random_drafter(rnd, k=2, fusion="fc", num_layers=2, seed=3, level_embedding=True).save_pretrained(
        str(base / "rnd_fc2_k2"))
    random_drafter(inc, k=2, fusion="fc", seed=4, level_embedding=True).save_pretrained(str(base / "rnd_inc_k2"))
    return {"dir": base, "inc": inc, "rnd": rnd, "ctx": ctx, "half": half}


def _engine_specs(base) -> dict:
    """name -> (target dir, speculative config, LLM kwargs); drafter names are folders under ``base``."""
    specs = {
        "vanilla_rnd": ("rnd", None, {}),
        "vanilla_ctx": ("ctx", None, {}),
        "falcon_rnd_k3": ("rnd", {"model": "rnd_lstm_k3", "num_speculative_tokens": 5}, {}),
        "falcon_rnd_k3_rev": ("rnd", {"model": "rnd_fc_k3_rev", "num_speculative_tokens": 5}, {}),
        "falcon_rnd_fc2": ("rnd", {"model": "rnd_fc2_k2", "num_speculative_tokens": 4}, {}),
        "falcon_rnd_fc2_unpadded": ("rnd", {"model": "rnd_fc2_k2", "num_speculative_tokens": 4,
                                            "disable_padded_drafter_batch": True}, {}),
        # vLLM's dynamic speculation: K=3 up to batch 3, no drafts from batch 4
        "falcon_rnd_sched": ("rnd", {"model": "rnd_lstm_k3", "num_speculative_tokens": 3,
                                     "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 1 << 20, 0]]}, {}),
        # chains cut where the drafter's probability of them falls below draft_confidence (the test sets it)
        "falcon_rnd_gate": ("rnd", {"model": "rnd_fc2_k2", "num_speculative_tokens": 4, "draft_confidence": 1e-9}, {}),
        "exact_k2": ("inc", {"model": "exact_k2", "num_speculative_tokens": 5}, {}),
        "exact_k3": ("inc", {"model": "exact_k3_official", "num_speculative_tokens": 4, "falcon_k": 3}, {}),
        "ctx": ("ctx", {"model": "exact_k2", "num_speculative_tokens": 5}, {}),
        # prompt lookup first (n-grams 2-3, up to 4 tokens), the drafter's chain of 3 otherwise (level embedding)
        "falcon_rnd_lookup": ("rnd", {"model": "rnd_fc_k3_rev", "num_speculative_tokens": 4, "falcon_tokens": 3,
                                      "prompt_lookup_min": 2, "prompt_lookup_max": 3}, {}),
        # ... and the target's stored answers where the request's own tokens repeat nothing (written by the test)
        "falcon_rnd_lookup_ds": ("rnd", {"model": "rnd_lstm_k3", "num_speculative_tokens": 4, "falcon_tokens": 3,
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 3, "datastore": "ds.npz",
                                         "datastore_tokens": 3}, {}),
        # unpadded drafter batches, adaptive lookup lengths (2, doubled to 4 after a lookup draft accepted whole)
        "falcon_rnd_lookup_unpadded": ("rnd", {"model": "rnd_lstm_k3", "num_speculative_tokens": 4,
                                               "falcon_tokens": 3, "lookup_tokens": 2, "prompt_lookup_min": 2,
                                               "prompt_lookup_max": 3, "disable_padded_drafter_batch": True}, {}),
        # adaptive lookup lengths 2 -> 4 -> 8 on the increment target, whose continuations a prompt can spell out
        "inc_lookup_adaptive": ("inc", {"model": "exact_k2", "num_speculative_tokens": 8, "falcon_tokens": 2,
                                        "lookup_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 3}, {}),
        # ... with a random drafter, whose drafts depend on every K/V it attends to
        "inc_lookup_rnd": ("inc", {"model": "rnd_inc_k2", "num_speculative_tokens": 8, "falcon_tokens": 2,
                                   "lookup_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 3}, {}),
        # ... drafting at batch 1 only
        "inc_lookup_sched": ("inc", {"model": "rnd_inc_k2", "num_speculative_tokens": 8, "falcon_tokens": 2,
                                     "lookup_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 3,
                                     "num_speculative_tokens_per_batch_size": [[1, 1, 8], [2, 1 << 20, 0]]}, {}),
        "ctx_lookup": ("ctx", {"model": "exact_k2", "num_speculative_tokens": 4, "falcon_tokens": 2,
                               "prompt_lookup_min": 1, "prompt_lookup_max": 2}, {}),
        # drafts sampled from the drafter, their distributions verified by vLLM's rejection sampler
        "ctx_prob": ("ctx", {"model": "exact_k2", "num_speculative_tokens": 4,
                             "draft_sample_method": "probabilistic"}, {}),
        # ... cut where the drafter's probability of the drawn tokens falls below 0.1 (draft_confidence)
        "ctx_prob_gate": ("ctx", {"model": "exact_k2", "num_speculative_tokens": 4,
                                  "draft_sample_method": "probabilistic", "draft_confidence": 0.1}, {}),
        # ... with lookup, a head over half the vocabulary, and the drafter at half the request's temperature
        "ctx_lookup_prob": ("ctx", {"model": "exact_k2_half", "num_speculative_tokens": 4, "falcon_tokens": 2,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                    "draft_sample_method": "probabilistic", "draft_temperature_scale": 0.5}, {}),
    }
    out = {}
    for name, (target, spec, kw) in specs.items():
        if spec is not None:
            spec = dict(spec, method="falcon", model=str(base / spec["model"]))
            if "datastore" in spec:
                spec["datastore"] = str(base / spec["datastore"])
            kw = dict(kw, per_request_spec_decode_metrics="detailed")
        out[name] = (str(base / target), spec, kw)
    return out


@pytest.fixture(scope="module")
def engines(ckpts):
    e = EngineCache(_engine_specs(ckpts["dir"]))
    yield e
    e.close()


def _record_drafts(prop):
    """Wrap the proposer instance's propose() to record each step's drafts per request id."""
    log, orig = [], prop.propose

    def propose(*a, **kw):
        out = orig(*a, **kw)
        # the engine's request ids are the user's with a random suffix
        log.append({r.rsplit("-", 1)[0]: d for r, d in zip(prop._req_ids(out.shape[0]), out.tolist())})
        return out

    prop.propose = propose
    return log


# ---------------------------------------------------------------------- losslessness (random drafters)
PROMPTS = [[11, 12, 13], list(range(200, 237)), [5] * 9, list(range(1000, 1020))]
SHORT = [[7], [300, 301]]  # shorter than k: the relaxed block has rows with unknown inputs


def _cached_prompt(llm):
    """A prompt two tokens longer than a KV block: resubmitted, only 2 (< k) tokens are computed."""
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    return [(17 * i) % 30000 + 50 for i in range(bs + 2)]


def test_vanilla_reference(engines, ckpts):
    llm = engines.get("vanilla_rnd")
    prompts = PROMPTS + SHORT + [_cached_prompt(llm)]
    ckpts["vanilla"] = {tuple(p): t for p, t in zip(prompts, _greedy(llm, prompts)[0])}
    ckpts["vanilla_seeded"] = seeded(llm, PROMPTS + SHORT)


@pytest.mark.parametrize("name", ["falcon_rnd_k3", "falcon_rnd_fc2_unpadded"])
def test_random_drafter_greedy_identical_to_vanilla(engines, ckpts, name):
    ref = ckpts.get("vanilla")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    llm = engines.get(name)
    prop = drafter_of(llm)
    assert type(prop).__name__ == "FalconProposer" and prop.falcon is not None
    before = spec_counters(llm)
    for p in PROMPTS[:2] + SHORT:                                            # batch 1
        assert _greedy(llm, [p])[0][0] == ref[tuple(p)], p
    got, _ = _greedy(llm, PROMPTS + SHORT)                                  # batch 6, mixed lengths
    assert got == [ref[tuple(p)] for p in PROMPTS + SHORT]
    cached = _cached_prompt(llm)                                           # prefix-cache hit: only
    assert _greedy(llm, [cached])[0][0] == _greedy(llm, [cached])[0][0] == ref[tuple(cached)]  # 2 new tokens
    d = counter_delta(spec_counters(llm), before)
    K = prop.num_speculative_tokens
    assert d["num_drafts"] > 0 and d["num_draft_tokens"] == K * d["num_drafts"]
    assert prop.passes == prop.steps * math.ceil(K / prop.k)


def test_no_drafts_step_is_a_vanilla_step(engines, ckpts, monkeypatch):
    """Chain mode under vLLM's per-batch-size schedule: at batch 6 nothing is drafted, and such a step samples
    with vLLM's plain sampler as a vanilla step does (no rejection sampler on empty drafts): greedy and seeded
    random sampling return vanilla's exact tokens.  At batch 1 the chain drafts and is verified as usual."""
    ref, ref_seeded = ckpts.get("vanilla"), ckpts.get("vanilla_seeded")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    llm = engines.get("falcon_rnd_sched")
    runner = runner_of(llm)
    calls = []
    rejection = runner.rejection_sampler
    monkeypatch.setattr(runner, "rejection_sampler", lambda *a, **k: calls.append(1) or rejection(*a, **k))
    skipped = drafter_of(llm).skipped_steps
    assert _greedy(llm, PROMPTS + SHORT)[0] == [ref[tuple(p)] for p in PROMPTS + SHORT]
    assert seeded(llm, PROMPTS + SHORT) == ref_seeded
    assert calls == [] and drafter_of(llm).skipped_steps > skipped
    assert _greedy(llm, PROMPTS[:1])[0][0] == ref[tuple(PROMPTS[0])] and calls


def _expected_lookup(hist, lo, hi, K):
    """Brute force: the K tokens after the earliest earlier occurrence of the longest suffix n-gram (lo <= n <= hi)."""
    for n in range(min(hi, len(hist) - 1), lo - 1, -1):
        for j in range(len(hist) - n):
            if hist[j:j + n] == hist[-n:]:
                return hist[j + n:j + n + K]
    return []


def _replay_lookup_length(L, lookup_draft, accepted, lookup_tokens, K):
    """A request's next lookup length: doubled (up to K) after a lookup draft accepted whole, back to
    ``lookup_tokens`` after one cut short, unchanged after a drafter step (``lookup_draft`` empty)."""
    if not lookup_draft:
        return L
    return min(2 * L, K) if accepted == len(lookup_draft) else lookup_tokens


def test_adaptive_lookup_length(engines):
    """``lookup_tokens`` 2, K=8 on the increment target (greedy: t+1 after t): the prompt spells out the answer
    100..139 with one wrong token (500 for 120), so lookup drafts are accepted whole until they reach it.  The
    replay predicts every draft; lookup lengths run 2, 4, 8 (whole drafts), back to 2 after the draft cut at
    500, and the drafter serves the step after it, where the history's 2-gram ``119 120`` occurs nowhere."""
    llm = engines.get("inc_lookup_adaptive")
    src = list(range(100, 120)) + [500] + list(range(121, 140))
    prompt = src + [100, 101]
    log = _record_merged(drafter_of(llm).lookup)
    try:
        toks = _greedy(llm, [prompt], n=36)[0][0]
    finally:
        del drafter_of(llm).lookup.merge
    assert toks == list(range(102, 138))  # the increment target's greedy answer
    m, L, lengths, kinds = 1, 2, [], []
    for d in log:
        if m >= len(toks):
            break
        want = _expected_lookup(prompt + toks[:m], 2, 3, L)
        if want:
            assert d == want, (m, d, want, L)
            lengths.append(L)
        else:
            assert d == toks[m:m + 2], (m, d)  # the exact drafter's chain of falcon_tokens
        kinds.append("lookup" if want else "falcon")
        a = 0
        while a < len(d) and m + a < len(toks) and d[a] == toks[m + a]:
            a += 1
        L = _replay_lookup_length(L, want, a, 2, 8)
        m += a + 1
    assert lengths[:5] == [2, 4, 8, 8, 2], lengths
    assert "falcon" in kinds and 8 in lengths[5:], (kinds, lengths)  # and grows again after the drafter's step


def test_lookup_length_record_at_small_budgets():
    """The adaptive record is kept at every budget: a whole lookup draft at a budget k <= lookup_tokens still
    doubles the next length (a stale record would compare the history against a step two drafts old)."""
    from types import SimpleNamespace

    import numpy as np

    from falcon_vllm.core.lookup import LookupState
    from falcon_vllm.vllm.hooks import plan_v1_step

    hist = [1, 2, 3, 4, 5] * 4  # periodic: every suffix has an earlier match

    def step(lk, k):
        batch = SimpleNamespace(num_reqs=1, req_ids=["r"], token_ids_cpu=np.array([hist + [0] * 64], dtype=np.int32),
                                num_tokens_no_spec=np.array([len(hist)]))
        runner = SimpleNamespace(input_batch=batch, discard_request_mask=SimpleNamespace(np=np.array([False])),
                                 max_model_len=1024)
        d = plan_v1_step(lk, runner, torch.full((1, 1), -1), k).lookup[0]
        hist.extend(d + [(len(hist) + len(d)) % 5 + 1])  # accepted whole, then the bonus token
        return len(d)

    lk = LookupState(2, 3, falcon_tokens=2, lookup_tokens=2)
    assert [step(lk, 8), step(lk, 2), step(lk, 8), step(lk, 8), step(lk, 1), step(lk, 8)] == [2, 2, 4, 8, 1, 2]


def _record_merged(lk):
    """Wrap a LookupState instance's merge() to record each step's drafts (batch 1: the request's draft)."""
    log, orig = [], lk.merge

    def merge(plan, falcon, probs=None):
        out = orig(plan, falcon, probs)
        log.append(out[0][0])
        return out

    lk.merge = merge
    return log


@pytest.mark.parametrize("name", ["falcon_rnd_lookup", "falcon_rnd_lookup_unpadded"])
def test_prompt_lookup_first_then_falcon(engines, ckpts, name):
    """Prompt lookup first, the drafter's chain otherwise.  Each step's drafts are replayed against the
    request's actual history (prompt + the tokens committed so far, from vanilla's output and the drafts'
    accepted prefixes): a request whose history ends in a repeated n-gram gets exactly the brute-force lookup
    draft, any other the drafter's chain of ``falcon_tokens``; outputs equal vanilla's at batch 1 and 6, and a
    batch-1 step served by lookup runs no drafting pass.  Padded drafter batches (vLLM drafts before its
    bookkeeping) and unpadded ones (after it) alike; the unpadded engine has adaptive lookup lengths
    (``lookup_tokens`` 2, K=4), which the replay tracks per request (:func:`_replay_lookup_length`)."""
    ref = ckpts.get("vanilla")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    llm = engines.get(name)
    prop = drafter_of(llm)
    lk = prop.lookup
    assert lk is not None and (lk.min_n, lk.max_n, lk.falcon_tokens, prop.num_speculative_tokens) == (2, 3, 3, 4)
    adaptive = name == "falcon_rnd_lookup_unpadded"
    assert lk.lookup_tokens == (2 if adaptive else 4)
    log, orig = [], lk.merge

    def merge(plan, falcon, probs=None):
        out = orig(plan, falcon, probs)
        ids = [r.rsplit("-", 1)[0] for r in runner_of(llm).input_batch.req_ids]  # the user's id + a suffix
        log.append((dict(zip(ids, out[0])), falcon.shape[1] == 0))
        return out

    lk.merge = merge
    batch1 = PROMPTS[:3] + SHORT
    try:
        single = [_greedy(llm, [p]) for p in batch1]
        batched = _greedy(llm, PROMPTS + SHORT)
    finally:
        del lk.merge
    assert [t[0] for t, _ in single] == [ref[tuple(p)] for p in batch1]
    assert batched[0] == [ref[tuple(p)] for p in PROMPTS + SHORT]
    runs = [([p], t, o) for p, (t, o) in zip(batch1, single)] + [(PROMPTS + SHORT, *batched)]
    n_lookup = n_falcon = 0
    lengths = set()
    for batch, toks, outs in runs:
        for p, t, o in zip(batch, toks, outs):
            m = 1  # output tokens committed when the step drafts (the prefill step samples the first)
            L = lk.lookup_tokens
            for d in [step[o.request_id] for step, _ in log if o.request_id in step]:
                if m >= len(t):
                    break
                want = _expected_lookup(p + t[:m], 2, 3, L)
                if want:
                    assert d == want, (p, m, d, want, L)
                    n_lookup += 1
                    lengths.add(L)
                else:
                    assert len(d) == 3, (p, m, d)
                    n_falcon += 1
                a = 0
                while a < len(d) and m + a < len(t) and d[a] == t[m + a]:
                    a += 1
                L = _replay_lookup_length(L, want, a, lk.lookup_tokens, 4)
                m += a + 1
    assert n_lookup > 0 and n_falcon > 0, (n_lookup, n_falcon)
    assert lengths == {2} if adaptive else {4}, lengths  # the random target never accepts a lookup draft whole
    assert any(skipped for _, skipped in log)  # batch-1 steps served by lookup alone ran no drafting pass


@pytest.mark.parametrize("name", ["falcon_rnd_lookup", "falcon_rnd_lookup_unpadded", "inc_lookup_rnd"])
def test_lookup_steps_defer_the_drafter_pass(engines, ckpts, name):
    """A step whose drafts all come from prompt lookup runs no drafter pass (``defer_chunk``): its verified rows wait
    and the next drafter pass runs them first, with the level offsets they had.  With a 1-layer drafter (the K/V at a
    position depends only on that row's inputs and offset) every step's drafts equal those of a drafter pass at every
    step, at batch 1 and above, padded and unpadded drafter batches; outputs equal vanilla's; the deferred steps are
    exactly the drafter forwards saved, and passes ran deferred rows.  On the increment target, prompts that spell out
    their continuation get lookup drafts accepted whole step after step: rows deferred by several steps in a row
    accumulate, and a step that would take them past ``defer_rows`` runs the pass instead."""
    llm = engines.get(name)
    prop = drafter_of(llm)
    stash = prop._stash
    assert prop.defer_chunk and prop.fuse_chunk and prop.defer_rows == 32  # the CPU platform's defaults
    if name.startswith("inc"):
        src = list(range(100, 150)) + [500] + list(range(151, 170))
        batches, n = [[src + [100, 101]], [src + [100, 101], src + [110, 111]]], 40
        expect = {tuple(p): list(range(p[-1] + 1, p[-1] + 1 + n)) for b in batches for p in b}
    else:
        expect, n = ckpts.get("vanilla"), 24
        if expect is None:
            pytest.skip("needs test_vanilla_reference")
        batches = [[p] for p in PROMPTS[:3] + SHORT] + [PROMPTS + SHORT]
    drafts, forwards, deferred, taken, merged, refused = {}, {}, {}, [], [], []
    orig_take, orig_defer, orig_forward = stash.take, stash.defer, prop._forward

    def take(*a):
        out = orig_take(*a)
        taken.append(0 if out is None else len(out[0]))
        return out

    def defer(slots, rows, cap):
        before = {s for s in slots if s in stash.pending}
        ok = orig_defer(slots, rows, cap)
        refused.append(not ok)
        merged.extend(ok and s in before and stash.num_rows(s) > len(r[0]) for s, r in zip(slots, rows))
        return ok

    for on in (True, False):
        prop.defer_chunk = on
        log, calls, d0 = _record_drafts(prop), [], prop.deferred_steps
        prop._forward = lambda *a: (calls.append(1), orig_forward(*a))[1]
        stash.take, stash.defer = take, defer
        try:
            runs = [_greedy(llm, b, n=n) for b in batches]
        finally:
            del prop.propose, prop._forward, stash.take, stash.defer
            prop.defer_chunk = True
        for b, (toks, _) in zip(batches, runs):
            assert toks == [expect[tuple(p)][:n] for p in b]
        drafts[on] = [[[step[o.request_id] for step in log if o.request_id in step] for o in outs] for _, outs in runs]
        forwards[on], deferred[on] = len(calls), prop.deferred_steps - d0
    assert drafts[True] == drafts[False]
    assert deferred[False] == 0 and deferred[True] > 0, deferred
    assert forwards[True] == forwards[False] - deferred[True], (forwards, deferred)
    assert any(taken), taken
    if name.startswith("inc"):
        assert any(merged) and any(refused), (merged, refused)


def test_datastore_drafts_where_lookup_finds_nothing(engines, ckpts):
    """With a datastore, a request whose own tokens repeat nothing gets the stored answers' draft (replayed against
    the request's history with the same store, at most datastore_tokens long), the drafter's chain only where
    neither finds one; outputs equal vanilla's, and the requests whose answers the store holds have their stored
    drafts accepted."""
    from falcon_vllm.datastore import Datastore

    ref = ckpts.get("vanilla")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    store = Datastore.from_answers([ref[tuple(p)] for p in PROMPTS[:2]], min_n=2, max_n=3)
    store.save(str(ckpts["dir"] / "ds.npz"))  # read when the engine starts
    llm = engines.get("falcon_rnd_lookup_ds")
    lk = drafter_of(llm).lookup
    assert lk.store is not None and len(lk.store) == len(store) and lk.store_tokens == 3
    log, orig = [], lk.merge

    def merge(plan, falcon, probs=None):
        out = orig(plan, falcon, probs)
        log.append(dict(zip([r.rsplit("-", 1)[0] for r in runner_of(llm).input_batch.req_ids], out[0])))
        return out

    lk.merge = merge
    try:
        runs = [(p, *_greedy(llm, [p])) for p in PROMPTS + SHORT]
    finally:
        del lk.merge
    counts = {"lookup": 0, "store": 0, "chain": 0}
    store_accepted = 0
    for p, toks, outs in runs:
        t = toks[0]
        assert t == ref[tuple(p)]
        m = 1
        for d in [step[outs[0].request_id] for step in log if outs[0].request_id in step]:
            if m >= len(t):
                break
            hist = p + t[:m]
            want, kind = _expected_lookup(hist, 2, 3, 4), "lookup"
            if not want:
                want, kind = store.draft(hist, 3), "store"  # datastore_tokens 3 below the lookup's 4
            if want:
                assert d == want, (p, m, d, want, kind)
            else:
                kind = "chain"
                assert len(d) == 3, (p, m, d)
            counts[kind] += 1
            a = 0
            while a < len(d) and m + a < len(t) and d[a] == t[m + a]:
                a += 1
            store_accepted += a if kind == "store" else 0
            m += a + 1
    assert counts["store"] > 0 and counts["chain"] > 0, counts
    assert store_accepted > 10, (store_accepted, counts)  # the stored answers are the target's own
    # datastore_max_batch 1 (as the shipped serving.json): the store is looked up only in steps of one request
    from falcon_vllm.core import lookup

    steps, orig_drafts = [], lookup.lookup_drafts

    def lookup_drafts(token_ids, num_tokens, sampled, use, *a):
        steps.append((len(use), a[4] is not None))  # (requests in the step, store passed)
        return orig_drafts(token_ids, num_tokens, sampled, use, *a)

    lookup.lookup_drafts, lk.store_max_batch = lookup_drafts, 1
    try:
        batched = _greedy(llm, PROMPTS + SHORT)[0]
    finally:
        lookup.lookup_drafts, lk.store_max_batch = orig_drafts, None
    assert batched == [ref[tuple(p)] for p in PROMPTS + SHORT]
    assert any(b > 1 for b, _ in steps) and all(used == (b == 1) for b, used in steps), steps


def test_draft_confidence_cuts_chains(engines, ckpts):
    """draft_confidence: each request's chain stops before its first token where the product of the drafter's
    probabilities of its tokens falls below the threshold, and the second drafter pass (K=4, k=2) runs only when some
    request's first block passed whole; the probabilities are the drafter's softmax at its drafted (argmax) tokens.
    Outputs equal vanilla's at batch 1 and 6.  The thresholds are medians of a first run's products (of the first
    token's probability, of the first three's), so that empty drafts, drafts stopping in either block, and steps with
    and without the second pass all occur."""
    ref = ckpts.get("vanilla")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    llm = engines.get("falcon_rnd_gate")
    prop = drafter_of(llm)
    log, same = [], []
    orig_cut, orig_draft = prop.cut, prop._draft

    def draft(rows, sm=None, probs=None, conf=None):
        toks = orig_draft(rows, sm, probs, conf)
        p = prop.model.compute_logits(rows.reshape(-1, rows.shape[-1])).float().softmax(-1).amax(-1)
        same.append(conf is not None and torch.allclose(conf[-1].reshape(-1).cpu(), p.cpu()))
        return toks

    def cut(chain):
        conf = prop.last_confidence.cpu().clone()
        log.append((chain.tolist(), conf, prop.passes, orig_cut(chain)))
        return log[-1][-1]

    prop._draft, prop.cut = draft, cut
    lengths, second = [], []
    try:
        _greedy(llm, PROMPTS)
        conf = torch.cat([c for _, c, _, _ in log])
        for j in (1, 3):  # thresholds: the median of the first token's probability, of the first three's product
            tau = float(conf[:, :j].prod(1).median())
            prop.draft_confidence = tau
            log.clear()
            single = [_greedy(llm, [p])[0][0] for p in PROMPTS]
            batched = _greedy(llm, PROMPTS + SHORT)[0]
            assert single == [ref[tuple(p)] for p in PROMPTS]
            assert batched == [ref[tuple(p)] for p in PROMPTS + SHORT]
            for i, (chain, c, passes, out) in enumerate(log):
                ran = len(chain[0]) == 4
                assert ran == bool((c[:, :2].prod(1) >= tau).any()), (c, tau)
                second.append(ran)
                if i:  # this step's drafter passes: the fused one, and the second when it ran
                    assert passes - log[i - 1][2] == 1 + ran
                for row, p, d in zip(chain, c, out):
                    n = int((p.cumprod(0) >= tau).sum())
                    assert d == row[:n], (row, p, d, tau)
                    lengths.append(n)
    finally:
        del prop._draft, prop.cut
        prop.draft_confidence = 1e-9
    assert same and all(same)
    # no draft, drafts stopped inside the first block and drafts that went on into the second; steps with and without it
    assert {0, 1, 3} <= set(lengths) and any(second) and not all(second), (sorted(set(lengths)), second)


@pytest.mark.parametrize("name", ["falcon_rnd_fc2", "falcon_rnd_fc2_unpadded"])
def test_fused_chunk_pass_equals_two_passes(engines, ckpts, name):
    """On CPU the chunk pass and the relaxed block run as one drafter pass (per-request causal flags); with a
    2-layer drafter (whose block sees the chunk's layer-1 K/V, which depends on the chunk's causal mask) every
    step's drafts equal those of the two separate passes, padded and unpadded drafter batches alike (the drafter has
    a level embedding: both give the chunk's rows their offsets from each request's end).  The fused pass runs only
    the chunk rows before each request's block (``prune_chunk``): each step's pass has exactly
    sum(max(0, valid rows - k)) + B*k rows (prefill steps with and without chunk groups, decode steps without), and
    its drafts equal those of the fused pass over every chunk row."""
    ref = ckpts.get("vanilla")
    if ref is None:
        pytest.skip("needs test_vanilla_reference")
    llm = engines.get(name)
    prop = drafter_of(llm)
    assert prop.fuse_chunk and prop.prune_chunk  # the CPU platform's defaults
    k = prop.k
    drafts, rows = {}, []
    orig_fused, orig_inputs = prop._fused_pass, prop._relaxed_block_inputs

    def relaxed_block_inputs(cad, last, B):  # vLLM's layout: each request's valid chunk rows end at ``last``
        valid = last.cpu() - cad.query_start_loc_cpu[:B].long() + 1
        rows.append([int((valid - k).clamp(min=0).sum()) + B * k, B])
        return orig_inputs(cad, last, B)

    def fused_pass(cad, num_tokens, *a):
        orig_forward = prop._forward
        prop._forward = lambda per_layer, n, slots: (rows[-1].append(n), orig_forward(per_layer, n, slots))[1]
        try:
            return orig_fused(cad, num_tokens, *a)
        finally:
            del prop._forward

    for mode in ("pruned", "every chunk row", "two passes"):
        prop.fuse_chunk, prop.prune_chunk = mode != "two passes", mode == "pruned"
        log = _record_drafts(prop)
        if mode == "pruned":
            prop._fused_pass, prop._relaxed_block_inputs = fused_pass, relaxed_block_inputs
        try:
            tokens, outs = _greedy(llm, PROMPTS + SHORT, n=24)
        finally:
            del prop.propose
            for wrapped in ("_fused_pass", "_relaxed_block_inputs"):
                prop.__dict__.pop(wrapped, None)
            prop.fuse_chunk = prop.prune_chunk = True
        assert tokens == [ref[tuple(p)][:24] for p in PROMPTS + SHORT]
        drafts[mode] = [[step[o.request_id] for step in log if o.request_id in step] for o in outs]
    assert drafts["pruned"] == drafts["every chunk row"] == drafts["two passes"]
    assert sum(map(len, drafts["pruned"])) > 40
    assert rows and all(len(r) == 3 and r[0] == r[2] for r in rows), rows  # [expected rows, B, the pass's rows]
    assert any(n > B * k for n, B, _ in rows) and any(n == B * k for n, B, _ in rows), rows  # prefills; decodes


@pytest.mark.parametrize("name,drafter_dir", [("falcon_rnd_k3", "rnd_lstm_k3"), ("falcon_rnd_k3_rev", "rnd_fc_k3_rev")])
def test_drafts_match_reference_engine(engines, ckpts, name, drafter_dir):
    """vLLM's SAR drafts (relaxed block + stash + block passes) equal the reference engine's, for the
    paper's block order and the reversed one (level 1 from the block's last row) with a level embedding
    (the chunk's rows offset from each request's end, the blocks' rows 0..k-1, as the reference lays them out).

    The random drafter is rejected at almost every step, so nearly every relaxed block takes its
    older k-1 rows from the stash.  Prompts shorter than k are compared from round k on (the
    reference pads them with virtual positions that vLLM cannot represent in its paged cache).
    """
    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.reference import FalconReferenceEngine

    llm = engines.get(name)
    prop = drafter_of(llm)
    K, k = prop.num_speculative_tokens, prop.k
    prompts = [PROMPTS[0], PROMPTS[1], SHORT[0]]
    log = _record_drafts(prop)
    try:
        tokens, outs = _greedy(llm, prompts, n=24)
    finally:
        del prop.propose
    drafter = FalconDrafter.from_pretrained(str(ckpts["dir"] / drafter_dir))
    assert drafter.config.block_order == ("reversed" if name.endswith("_rev") else "forward")
    assert drafter.config.level_embedding == name.endswith("_rev")
    eng = FalconReferenceEngine(ckpts["rnd"], drafter, tree=f"chain-{K}")
    for p, toks, o in zip(prompts, tokens, outs):
        ref_tokens, ref_drafts = reference_drafts(eng, p, 24)
        assert ref_tokens == toks
        ours = [step[o.request_id] for step in log if o.request_id in step]
        first = 0 if len(p) >= k else k
        n = len(ref_drafts) - 1  # the last round may be trimmed by vLLM's max_tokens
        assert n - first >= 10 and ours[first:n] == ref_drafts[first:n], p


def test_sampling_runs_with_random_drafter(engines):
    from vllm import SamplingParams

    llm = engines.get("falcon_rnd_k3")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=1, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)


# ---------------------------------------------------------------------- exact drafters: full acceptance
PROMPTS_INC = [[5, 6, 7], [100, 101, 102, 103, 104, 105, 106], [9000, 9001, 9002]]


def _record_takes(stash) -> list:
    """Record every batch of pending rows the stash hands a drafter pass (until ``del stash.take``)."""
    taken, orig_take = [], stash.take

    def take(*a):
        out = orig_take(*a)
        if out is not None:
            taken.append(out)
        return out

    stash.take = take
    return taken


def test_drafting_off_steps_keep_their_rows_for_the_drafter(engines, ckpts):
    """Prompt lookup first, drafting at batch 1 only, on the increment target (greedy: t+1) with a random drafter.
    Two requests prefill and decode together (drafting off), then the short one finishes and the long one goes on at
    batch 1.  The steps at batch 2 kept their verified rows (``keep_gap_rows``): the first drafter pass at batch 1
    runs them, every position of the long request from 0 on, each with the sequence's next token and the target's
    final-norm feature at its position, so its drafter K/V has no gap and it gets drafter chains again (its prompt's
    lookup drafts end at 140).  Outputs are the target's greedy ones."""
    from vllm import SamplingParams

    llm = engines.get("inc_lookup_sched")
    prop = drafter_of(llm)
    lk, stash = prop.lookup, prop._stash
    long_p, short_p = list(range(100, 140)) + [100], [7000, 7001]
    chains, skipped, gap = lk.falcon_drafts, prop.skipped_steps, prop.gap_steps
    taken = _record_takes(stash)
    try:
        outs = llm.generate([{"prompt_token_ids": long_p}, {"prompt_token_ids": short_p}],
                            [SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                             SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)], use_tqdm=False)
    finally:
        del stash.take
    assert list(outs[0].outputs[0].token_ids) == list(range(101, 151))
    assert list(outs[1].outputs[0].token_ids) == [7002, 7003, 7004]
    assert prop.skipped_steps > skipped and prop.gap_steps == gap  # batch 2 drafted nothing and kept its rows
    assert lk.falcon_drafts > chains and not lk.gapped and not stash.pending  # the long request's chains resume
    req, ids, feats, _, pos = taken[0]  # the first pass after batch 2: the long request alone
    seq = long_p + list(range(101, 151))
    assert (req == 0).all() and pos.tolist() == list(range(len(pos))) and len(pos) >= len(long_p) + 1
    assert ids.tolist() == seq[1:len(pos) + 1]
    with torch.no_grad():
        ref = ckpts["inc"].model(torch.tensor([seq])).last_hidden_state[0, :len(pos)]
    torch.testing.assert_close(feats.float(), ref.float(), atol=1e-3, rtol=1e-3)


def test_requests_with_a_drafter_gap_get_no_chain(engines):
    """The same, with room for fewer kept rows than the long prompt (``gap_rows`` 8): the long request's drafter K/V
    has a gap, so at batch 1 it gets no drafter chain and no drafter pass runs for it; its lookup drafts (its prompt
    spells out its continuation up to 139) stay.  A request that starts alone afterwards gets chains again.  Outputs
    are the target's greedy ones throughout."""
    from vllm import SamplingParams

    llm = engines.get("inc_lookup_sched")
    prop = drafter_of(llm)
    lk = prop.lookup
    long_p, short_p, fresh = list(range(100, 140)) + [100], [7000, 7001], [9000, 9001, 9003]
    chains, lookups, skipped, gap = lk.falcon_drafts, lk.lookup_drafts, prop.skipped_steps, prop.gap_steps
    prop.gap_rows = 8
    try:
        outs = llm.generate([{"prompt_token_ids": long_p}, {"prompt_token_ids": short_p}],
                            [SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                             SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)], use_tqdm=False)
    finally:
        prop.gap_rows = 64
    assert list(outs[0].outputs[0].token_ids) == list(range(101, 151))  # lookup drafts end at 140
    assert list(outs[1].outputs[0].token_ids) == [7002, 7003, 7004]
    assert prop.skipped_steps > skipped and prop.gap_steps > gap  # batch 2 drafted nothing; batch 1 ran no pass
    assert lk.falcon_drafts == chains and lk.lookup_drafts > lookups  # the long request: lookup drafts only
    gap = prop.gap_steps
    assert _greedy(llm, [fresh], n=12)[0][0] == list(range(9004, 9016))
    assert lk.falcon_drafts > chains and prop.gap_steps == gap and not lk.gapped  # a new request drafts again


def test_steps_past_falcon_max_batch_get_lookup_drafts_and_keep_their_rows(engines, ckpts):
    """``falcon_max_batch`` 1 on the increment target with a random drafter, lookup drafting at every batch size: at
    batch 2 the long request (its prompt spells out its continuation up to 139) gets lookup drafts, accepted, and no
    drafter pass runs; those steps keep their verified rows, the accepted drafts' included, so the first drafter pass
    at batch 1 runs every position of the long request from 0 on, each with the sequence's next token and the
    target's final-norm feature there, and the request gets drafter chains again.  Outputs are the target's greedy
    ones."""
    from vllm import SamplingParams

    llm = engines.get("inc_lookup_rnd")
    prop = drafter_of(llm)
    lk, stash = prop.lookup, prop._stash
    long_p, short_p = list(range(100, 140)) + [100], [7000, 7001]
    chains, lookup_only, skipped = lk.falcon_drafts, prop.lookup_only_steps, prop.skipped_steps
    c0 = spec_counters(llm)
    taken = _record_takes(stash)
    lk.falcon_max_batch = 1
    try:
        outs = llm.generate([{"prompt_token_ids": long_p}, {"prompt_token_ids": short_p}],
                            [SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                             SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)], use_tqdm=False)
    finally:
        del stash.take
        lk.falcon_max_batch = None
    assert list(outs[0].outputs[0].token_ids) == list(range(101, 151))
    assert list(outs[1].outputs[0].token_ids) == [7002, 7003, 7004, 7005]
    assert prop.lookup_only_steps - lookup_only >= 3 and prop.skipped_steps == skipped  # batch 2: lookup only
    assert lk.falcon_drafts > chains and not lk.gapped and not stash.pending  # the long request's chains resume
    req, ids, feats, _, pos = taken[0]  # the first pass after batch 2: the long request alone
    seq = long_p + list(range(101, 151))
    # its rows reach past the prompt and the tokens decoded one by one at batch 2: accepted lookup drafts were kept
    assert (req == 0).all() and pos.tolist() == list(range(len(pos))) and len(pos) >= len(long_p) + 4
    assert ids.tolist() == seq[1:len(pos) + 1]
    with torch.no_grad():
        ref = ckpts["inc"].model(torch.tensor([seq])).last_hidden_state[0, :len(pos)]
    torch.testing.assert_close(feats.float(), ref.float(), atol=1e-3, rtol=1e-3)
    assert counter_delta(spec_counters(llm), c0)["num_accepted_tokens"] > 0


@pytest.mark.parametrize("name,k,K", [("exact_k2", 2, 5), ("exact_k3", 3, 4)])  # k3: official key layout
def test_exact_drafter_accepts_everything(engines, name, k, K):
    llm = engines.get(name)
    prop = drafter_of(llm)
    assert (prop.k, prop.num_speculative_tokens) == (k, K)
    before, steps0, passes0 = spec_counters(llm), prop.steps, prop.passes
    toks, outs = _greedy(llm, PROMPTS_INC, n=30)
    for p, t in zip(PROMPTS_INC, toks):
        assert t == [(p[-1] + i) % V for i in range(1, 31)]
    c = counter_delta(spec_counters(llm), before)
    assert c["num_drafts"] > 0 and c["num_accepted_tokens"] == c["num_draft_tokens"] == K * c["num_drafts"]
    assert 1 + c["num_accepted_tokens"] / c["num_drafts"] == K + 1           # mean acceptance length
    assert c["num_accepted_tokens_per_pos"] == [c["num_drafts"]] * K
    for o in outs:                                                            # per-request metrics
        m = o.outputs[0].spec_decode_metrics.to_dict()
        assert m["mean_acceptance_length"] == K + 1 and m["draft_acceptance_rate"] == 1.0
    steps = prop.steps - steps0
    assert steps > 0 and prop.passes - passes0 == steps * math.ceil(K / k)  # counted, not assumed


@pytest.mark.parametrize("name,k", [("exact_k2", 2), ("exact_k3", 3)])
def test_short_prompts_recover_full_acceptance(engines, name, k):
    """Prompts shorter than k lose the first k-1 steps' level-1 drafts, then the stash fills the block."""
    llm = engines.get(name)
    prompts = [[40000 + i for i in range(n)] for n in range(1, k)]
    toks, outs = _greedy(llm, prompts, n=24)
    for p, t, o in zip(prompts, toks, outs):
        assert t == [(p[-1] + i) % V for i in range(1, 25)]
        m = o.outputs[0].spec_decode_metrics.to_dict()
        later = list(zip(m["per_step_accepted"], m["per_step_drafted"]))[k - len(p):]
        assert later and all(a == d for a, d in later), m


def _sample_chi_square(llm, ckpts, temperature, top_k, top_p, n=96, repeat=1, greedy=()):
    """Sample 12 tokens after ``n`` random prompts (a random 6-token prompt ``repeat`` times) on the context
    target -> (chi-square, counts, expected, spec counter delta, greedy outputs).  ``greedy`` prompts join the
    same batch as greedy requests of 16 tokens, spread among the sampled ones; their outputs come last (a
    list, empty without them)."""
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (6,), generator=g).tolist() * repeat for _ in range(n)]
    kw = {k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None}
    # unseeded: with prompt lookup or draft_confidence seeded requests get no drafts (their draws would depend on
    # their batch-mates); the process's generator, which the in-process engine samples from, is seeded instead
    reqs = [({"prompt_token_ids": p}, SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True, **kw))
            for p in prompts]
    at = [(i + 1) * n // (len(greedy) + 1) for i in range(len(greedy))]   # greedy rows inside the batch
    for i, p in reversed(list(zip(at, greedy))):
        reqs.insert(i, ({"prompt_token_ids": p}, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)))
    before = spec_counters(llm)
    torch.manual_seed(0)
    outs = llm.generate([r for r, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    greedy_at = {i + j for j, i in enumerate(at)}
    sampled = [o for i, o in enumerate(outs) if i not in greedy_at]
    chi2, counts, expected = context_chi_square(ckpts["ctx"], prompts, sampled, temperature, top_k, top_p)
    c = counter_delta(spec_counters(llm), before)
    return chi2, counts, expected, c, [list(outs[i].outputs[0].token_ids) for i in sorted(greedy_at)]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 3, None), (1.0, None, 0.8)])
def test_sampling_is_lossless(engines, ckpts, temperature, top_k, top_p):
    """Every generated token's bin (d = -2..2, other) against the context target's processed
    distribution given its actual prefix; T = 0.7 also catches a temperature lost on the way to the
    rejection sampler, top-k / top-p a truncation applied to one side only."""
    chi2, counts, expected, c, _ = _sample_chi_square(engines.get("ctx"), ckpts, temperature, top_k, top_p)
    assert chi2 < 23.0, (counts.tolist(), expected.tolist())  # chi-square, <= 5 dof, p ~ 3e-4
    # both branches of the rejection sampler ran: drafts were accepted and rejected
    assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"], c


def test_broken_acceptance_rule_is_caught(engines, ckpts, monkeypatch):
    """The test above can fail: with vLLM's uniforms scaled by 0.1 (a draft accepted with probability
    min(1, 10 p/q) instead of min(1, p/q)) the same statistic rejects.  (Squared uniforms, acceptance
    sqrt(p/q), gave chi-square 9 at this sample size: too subtle to separate from chance here.)"""
    import vllm.v1.sample.rejection_sampler as rs

    orig = rs.generate_uniform_probs
    monkeypatch.setattr(rs, "generate_uniform_probs", lambda *a, **kw: orig(*a, **kw) * 0.1)
    chi2, counts, expected, _, _ = _sample_chi_square(engines.get("ctx"), ckpts, 1.0, None, None)
    assert chi2 >= 23.0, (chi2, counts.tolist(), expected.tolist())  # the threshold above


def _draft_probs_seen(llm):
    """Wrap the runner's rejection sampler: a list of the draft_probs shapes it is given (None: point masses)."""
    sampler = llm.llm_engine.model_executor.driver_worker.worker.model_runner.rejection_sampler
    seen, orig = [], sampler.forward

    def forward(metadata, draft_probs, *a, **kw):
        seen.append(None if draft_probs is None else tuple(draft_probs.shape))
        return orig(metadata, draft_probs, *a, **kw)

    sampler.forward = forward
    return seen


@pytest.mark.parametrize("name", ["ctx_prob", "ctx_prob_gate", "ctx_lookup_prob"])
def test_sampled_drafts_are_lossless(engines, ckpts, name):
    """draft_sample_method "probabilistic": the drafter's tokens are drawn from its distribution at the request's
    temperature and that distribution goes to vLLM's rejection sampler (with prompt lookup, one-hot rows for the
    lookup drafts, a head over half the vocabulary, its probabilities placed at their target ids, and the drafter
    at half the request's temperature: draft_temperature_scale 0.5; with draft_confidence, drafts cut where the
    drawn tokens' probability falls below it); at temperature 1 and 0.7 the tokens follow the target's distribution.
    Greedy requests stay token-identical to vanilla's, alone and in a batch of sampled requests (at T 0.7, where the
    chi-square also checks the sampled rows among them)."""
    greedy = [list(range(300, 340)), [5, 9, 5, 9, 5, 9]]
    want = _greedy(engines.get("vanilla_ctx"), greedy, 16)[0]   # before the engine below (the cache may evict it)
    llm = engines.get(name)
    seen = _draft_probs_seen(llm)
    prop, bad, ok = drafter_of(llm), [], []
    support = torch.zeros(V, dtype=torch.bool)
    support[ckpts["half"] if name == "ctx_lookup_prob" else slice(None)] = True
    orig = prop._draft

    def draft(rows, sm=None, probs=None, conf=None):  # each pass's distributions: normalised, on the head's target
        toks = orig(rows, sm, probs, conf)                # ids only, positive at the tokens drawn from them
        if probs:
            p, t = probs[-1].cpu(), toks.cpu()
            (ok if torch.allclose(p.sum(-1), torch.ones(())) and not p[..., ~support].any()
             and bool((p.gather(-1, t[..., None]) > 0).all()) else bad).append(1)
        return toks

    prop._draft = draft
    lengths, orig_cut = [], prop.cut
    prop.cut = lambda chain: [lengths.append(len(d)) or d for d in orig_cut(chain)]
    for temperature in (1.0, 0.7):   # at 0.7 greedy requests share the batch: their rows keep the argmax
        chi2, counts, expected, c, mixed = _sample_chi_square(llm, ckpts, temperature, None, None, repeat=2,
                                                              greedy=greedy if temperature < 1 else ())
        assert chi2 < 23.0, (temperature, counts.tolist(), expected.tolist())
        assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"], c
        assert mixed == (want if temperature < 1 else [])   # the greedy requests: vanilla's tokens
    assert ok and not bad, (len(ok), len(bad))
    probs = [s for s in seen if s is not None]
    assert probs and all(len(s) == 2 and s[1] == V for s in probs), seen[:5]   # [drafted tokens, V]: probabilities
    if name == "ctx_lookup_prob":
        lk = drafter_of(llm).lookup
        assert lk.lookup_drafts and lk.falcon_drafts
    if name == "ctx_prob_gate":  # empty, cut and whole drafts were verified
        assert {0, 4} <= set(lengths) and set(lengths) & {1, 2, 3}, sorted(set(lengths))
    assert _greedy(llm, greedy, 16)[0] == want


def test_sampled_draft_rows_draw_from_what_they_hand_over(engines):
    """The unit under the chi-square above (whose peaked drafter hides a wrong temperature): each sampled draft row
    hands the rejection sampler the drafter's distribution at T x draft_temperature_scale, on its head's target ids,
    and its tokens are drawn from exactly that distribution (chi-square over 8 bins of equal mass per row, rows at
    temperatures 0.7 and 1.0 and logits flat enough that the temperature shows)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    from falcon_vllm.vllm.proposer import unwrap_model

    prop = drafter_of(engines.get("ctx_lookup_prob"))
    head, k, s = unwrap_model(prop.model), prop.k, prop.draft_temperature_scale
    assert s == 0.5 and head.truncated
    w = head.lm_head.weight.detach()
    pick = w[torch.tensor([11, 5000, 9000, 20000])].float()
    rows = (128.0 * pick / pick.square().sum(-1, keepdim=True)).view(2, k, -1)     # [B=2, k, H]; own logit 128
    temperature = torch.tensor([0.7, 1.0])
    sm = SamplingMetadata(temperature=temperature, all_greedy=False, all_random=True, top_p=None, top_k=None,
                          generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                          frequency_penalties=torch.zeros(2), presence_penalties=torch.zeros(2),
                          repetition_penalties=torch.ones(2), output_token_ids=[[], []], allowed_token_ids_mask=None,
                          bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    ids = head.to_target_ids(torch.arange(w.shape[0]))
    logits = prop.model.compute_logits(rows.view(2 * k, -1)).float()
    want = torch.zeros(2 * k, V)
    want[:, ids] = torch.softmax(logits / (temperature.repeat_interleave(k)[:, None] * s), -1)
    torch.manual_seed(0)
    n, drawn = 2000, []
    for _ in range(n):
        probs = []
        drawn.append(prop._draft(rows, sm, probs).view(-1))
        assert torch.allclose(probs[0].view(2 * k, V), want, atol=1e-6)
    drawn = torch.stack(drawn, 1)                                                    # [2k, n]
    for r in range(2 * k):
        order = want[r].argsort(descending=True)
        bins = torch.empty(V, dtype=torch.long)
        bins[order] = ((want[r][order].cumsum(0) - want[r][order]) * 8).long().clamp(max=7)
        expected = torch.zeros(8).index_add_(0, bins, want[r]) * n
        counts = torch.bincount(bins[drawn[r]], minlength=8).float()
        assert want[r].max() < 0.1 and expected.min() > 100, expected              # flat: the temperature shows
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 30.0, (r, counts.tolist(), expected.tolist())                 # 7 dof, p ~ 1e-4


def test_seeded_requests_repeat_with_sampled_drafts(engines):
    """With sampled drafts a seeded request draws its drafts from its own generator, as the rejection sampler
    draws from it: run alone twice (the process's global generator advanced in between) and among unseeded
    requests, it gives the same tokens.  Drafts drawn from the global generator give another output each run."""
    from vllm import SamplingParams

    llm = engines.get("ctx_prob")
    prompt = {"prompt_token_ids": [5, 9, 5, 9, 5, 9]}
    with_seed = SamplingParams(max_tokens=32, temperature=1.0, seed=7, ignore_eos=True)
    free = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)

    def run(prompts, params):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    before = spec_counters(llm)
    first = run([prompt], with_seed)[0]
    c = counter_delta(spec_counters(llm), before)
    assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"], c  # drafts drawn, some rejected
    torch.rand(1000)
    assert run([prompt], with_seed)[0] == first
    others = [{"prompt_token_ids": [300 + 11 * i + j for j in range(6)]} for i in range(3)]
    assert run([others[0], prompt, others[1], others[2]], [free, with_seed, free, free])[1] == first


def test_prefix_cache_after_a_burst_equals_a_fresh_engine(engines):
    """A burst at batch 3 (inc_lookup_sched drafts at batch 1 only) prefills a shared 300-token prefix with drafting
    off: its rows exceed gap_rows, so no drafter pass writes their drafter K/V.  Those blocks must leave the prefix
    cache: a later request with the same prefix then drafts as on a fresh engine (the same drafts, so the same
    acceptance).  Before, it hit the cached blocks and drafted over drafter K/V that was never written."""
    from vllm import SamplingParams

    llm = engines.get("inc_lookup_sched")
    prefix = [(13 * i) % 5000 + 300 for i in range(300)]
    one = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    prop = drafter_of(llm)

    def alone():
        before = spec_counters(llm)
        log = _record_drafts(prop)
        try:
            out = llm.generate([{"prompt_token_ids": prefix + [1, 2, 3]}], one, use_tqdm=False)[0]
        finally:
            del prop.propose
        c = counter_delta(spec_counters(llm), before)
        drafts = [d for step in log for d in step.values()]   # the random drafter's chains: they read every K/V
        return list(out.outputs[0].token_ids), drafts, (c["num_drafts"], c["num_draft_tokens"])

    llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": prefix + [7, 8, 9 + i]} for i in range(3)], one, use_tqdm=False)  # the burst
    after = alone()
    llm.reset_prefix_cache()
    fresh = alone()                       # (its own prefill writes every block it reads, whatever they held before)
    assert fresh[2][0] > 0 and any(fresh[1])
    assert after == fresh

    from falcon_vllm.vllm import prefix_gaps
    assert prefix_gaps.evicted > 0


@pytest.mark.parametrize("name,vanilla", [("falcon_rnd_lookup", "vanilla_rnd"), ("ctx_lookup_prob", "vanilla_ctx")])
def test_seeded_requests_with_lookup_do_not_depend_on_their_batch_mates(engines, name, vanilla):
    """With prompt lookup, whether a request gets a lookup draft, the drafter's chain or nothing depends on its
    batch-mates (a gap, ``falcon_max_batch``, whether a drafter pass runs at all), and so did a seeded request's
    draws from its generator.  Seeded sampled requests are served without drafts: alone, beside others and in a
    batch of 6 they give vanilla's tokens."""
    prompts = PROMPTS + SHORT
    ref = seeded(engines.get(vanilla), prompts)
    llm = engines.get(name)
    assert seeded(llm, prompts[:1]) == ref[:1]
    assert seeded(llm, prompts[:3]) == ref[:3]
    assert seeded(llm, prompts) == ref


@pytest.mark.parametrize("name", ["falcon_rnd_k3", "falcon_rnd_lookup"])
def test_structured_output_matches_vanilla(engines, ckpts, name):
    """A choice, a JSON schema and a regex, greedy, beside an unconstrained request: vanilla's tokens, with the
    drafter's chain and with prompt lookup (vLLM's scheduler checks drafts against each request's grammar)."""
    if "structured" not in ckpts:
        ckpts["structured"] = structured(engines.get("vanilla_rnd"))
    want = ckpts["structured"]
    llm = engines.get(name)
    before = spec_counters(llm)
    assert structured(llm) == want
    assert counter_delta(spec_counters(llm), before)["num_drafts"] > 0


def test_sampling_is_lossless_with_prompt_lookup(engines, ckpts):
    """Prompt lookup first, Falcon otherwise, at temperature 1: requests get drafts of different lengths (lookup
    drafts of up to 4 tokens from their repeated prompts, the drafter's chain of 2) and the tokens still follow
    the target's distribution."""
    llm = engines.get("ctx_lookup")
    lk = drafter_of(llm).lookup
    served = lk.lookup_drafts, lk.falcon_drafts
    chi2, counts, expected, c, _ = _sample_chi_square(llm, ckpts, 1.0, None, None, repeat=2)
    assert chi2 < 23.0, (counts.tolist(), expected.tolist())
    assert lk.lookup_drafts > served[0] and lk.falcon_drafts > served[1]  # both kinds of drafts were verified
    assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"], c
