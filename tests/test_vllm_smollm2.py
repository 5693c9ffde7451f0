"""falcon in vLLM on a real model: SmolLM2-135M-Instruct with the drafter shipped for it.

The drafter is found by the resolution rule (no path given: the shipped drafter whose recorded
target matches).  Greedy outputs must equal vanilla vLLM's at batch 1 and at batch 4 with prompts
of different lengths (MT-Bench first turns).
"""

import os
import re

import pytest

from tests.vllm_util import drafter_of, make_llm, model_path, shutdown_llm, spec_counters

from falcon_vllm.models import chat_ids, load_chat_prompts

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "falcon_vllm", "drafters", "smollm2-135m-instruct")
N = 32


@pytest.fixture(autouse=True)
def serving_default(monkeypatch):
    """The shipped drafter as served: draft_gemm_dtype auto (bf16 or int8 matmuls on CPUs that have the units)."""
    monkeypatch.setenv("FALCON_VLLM_DRAFT_GEMM_DTYPE", "auto")


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path())
    out = []
    for q in load_chat_prompts("mt-bench", 4):
        out.append(chat_ids(tok, [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True))
    assert len({len(p) for p in out}) > 1  # mixed prompt lengths
    return out


def _greedy(llm, prompts):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=N, temperature=0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _wave(llm, prompts):
    """The shipped default's traffic: greedy requests of staggered lengths (the batch shrinks 4 -> 1, across the
    schedule's batch-size boundary), then a concurrent sampled wave of 8, half of them seeded -> (greedy tokens,
    seeded tokens, sampled lengths)."""
    from vllm import SamplingParams

    greedy = [SamplingParams(max_tokens=8 * (i + 1), temperature=0, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    wave = [SamplingParams(max_tokens=12 + 4 * i, temperature=0.8, top_p=0.95, ignore_eos=True,
                           seed=10 + i if i % 2 else None) for i in range(8)]
    sampled = llm.generate([{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(8)], wave, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [list(o.outputs[0].token_ids) for i, o in enumerate(sampled) if i % 2],
            [len(o.outputs[0].token_ids) for o in sampled])


@pytest.fixture(scope="module")
def vanilla_runs(prompts):
    """One vanilla engine's greedy outputs and its shipped-default traffic (:func:`_wave`)."""
    llm = make_llm(model_path(), None, max_model_len=1024, max_num_seqs=4)
    try:
        return _greedy(llm, prompts), _wave(llm, prompts)
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def vanilla(vanilla_runs):
    return vanilla_runs[0]


@pytest.fixture(scope="module")
def vanilla_wave(vanilla_runs):
    return vanilla_runs[1]


def test_shipped_serving_json_as_shipped(prompts, vanilla_wave):
    """The bare ``{"method": "falcon"}``: the shipped drafter with its serving.json (prompt lookup, the datastore, the
    per-batch-size schedule, sampled drafts).  Greedy requests whose batch crosses the schedule's boundary give
    vanilla's tokens; in a concurrent sampled wave every request completes, and the seeded ones give vanilla's
    tokens (they are served without drafts)."""
    llm = make_llm(model_path(), {"method": "falcon"}, max_model_len=1024, max_num_seqs=4)
    try:
        prop = drafter_of(llm)
        sc = llm.llm_engine.vllm_config.speculative_config
        assert prop.lookup is not None and prop.lookup.store is not None            # lookup and the datastore
        assert prop._enable_probabilistic_draft_probs                               # sampled drafts
        assert sc.num_speculative_tokens_per_batch_size                             # the schedule
        before = spec_counters(llm)
        greedy, seeded_toks, lengths = _wave(llm, prompts)
        assert greedy == vanilla_wave[0]
        assert seeded_toks == vanilla_wave[1]
        assert lengths == vanilla_wave[2] == [12 + 4 * i for i in range(8)]
        assert spec_counters(llm)["num_drafts"] > before["num_drafts"]
    finally:
        shutdown_llm(llm)


@pytest.mark.parametrize("batch", [1, 4])
def test_shipped_drafter_greedy_identical(prompts, vanilla, batch):
    llm = make_llm(model_path(), {"method": "falcon", "num_speculative_tokens": 4},
                   max_model_len=1024, max_num_seqs=batch)
    try:
        sc = llm.llm_engine.vllm_config.speculative_config
        assert os.path.samefile(sc.draft_model_config.model, SHIPPED)  # resolved to the shipped drafter
        assert type(drafter_of(llm)).__name__ == "FalconProposer"
        before = spec_counters(llm)
        assert _greedy(llm, prompts) == vanilla
        after = spec_counters(llm)
        drafts = after["num_drafts"] - before["num_drafts"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        assert drafts > 0 and 0 < accepted <= 4 * drafts
    finally:
        shutdown_llm(llm)


@pytest.mark.parametrize("batch", [1, 8])
def test_shipped_drafter_tree_mode_greedy_identical(prompts, vanilla, batch):
    """Tree mode with the paper's tree (118 nodes) on the real model: identical greedy outputs."""
    llm = make_llm(model_path(), {"method": "falcon", "tree": "falcon-llama"}, max_model_len=1024,
                   max_num_seqs=batch)
    try:
        prop = drafter_of(llm)
        assert prop.tree is not None and prop.tree.num_nodes == 118
        before = spec_counters(llm)
        assert _greedy(llm, prompts) == vanilla
        after = spec_counters(llm)
        drafts = after["num_drafts"] - before["num_drafts"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        assert drafts > 0 and 0 < accepted <= 8 * drafts
        assert after["num_draft_tokens"] - before["num_draft_tokens"] == 118 * drafts
    finally:
        shutdown_llm(llm)


@pytest.mark.slow
def test_demo_command(capsys):
    """`make demo` (the README's first command), shortened: vanilla and falcon agree, and the speedup it prints is
    its tokens per step over its step cost."""
    from falcon_vllm import cli

    rc = cli.main(["demo", "--questions", "1", "--pairs", "2", "--max-tokens", "24"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy outputs identical: True" in out
    falcon = next(line for line in out.splitlines() if line.startswith("falcon  :"))
    tau = float(falcon.split(" tokens per step")[0].split(", ")[-1])
    assert 1.0 <= tau <= 5.0
    m = re.search(r"speedup : ([\d.]+)x over the whole run = ([\d.]+)x the tokens per step / ([\d.]+) step cost", out)
    assert m and abs(float(m[1]) - float(m[2]) / float(m[3])) < 0.02, out


@pytest.mark.parametrize("gemm", ["bfloat16", "int8", "model"])
def test_drafter_gemm_dtype_keeps_outputs(prompts, vanilla, gemm):
    """draft_gemm_dtype: the drafter's own matmuls (layers, fc, truncated head) in bf16, in int8 (oneDNN W8A8,
    the fp32 weights dropped) or in the model's dtype; the shared embedding and every activation stay fp32,
    and the outputs stay vanilla's."""
    import torch

    llm = make_llm(model_path(), {"method": "falcon", "num_speculative_tokens": 2, "draft_gemm_dtype": gemm},
                   max_model_len=1024, max_num_seqs=4)
    try:
        model = drafter_of(llm).model
        while hasattr(model, "unwrap"):
            model = model.unwrap()
        want = {"bfloat16": torch.bfloat16}.get(gemm, torch.float32)
        gemms = {name: m for name, m in model.named_modules()
                 if hasattr(m, "cpu_linear") and not name.endswith("embed_tokens")}  # the embedding is the target's
        assert {"lm_head", "model.fc"} <= set(gemms) and any(n.endswith("qkv_proj") for n in gemms)
        for name, m in gemms.items():
            assert m.weight.dtype == want, name
            assert m.weight.numel() == 0 or gemm != "int8", name  # int8: only oneDNN's packed copy is left
            assert getattr(m, "falcon_gemm_wrapped", False) == (gemm != "model"), name
        assert model.model.embed_tokens.weight.dtype == torch.float32
        # the drafter's RMSNorms run vLLM's C++ CPU kernels (model.CpuRMSNorm), with the checkpoint's weights
        norms = {n: m for n, m in model.named_modules()  # layer 0 has no input norm (EAGLE's layout)
                 if n.endswith("layernorm") and not isinstance(m, torch.nn.Identity)}
        assert len(norms) == 3 and all(type(m).__name__ == "CpuRMSNorm" for m in norms.values()), norms
        assert all(not torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms.values())
        before = spec_counters(llm)
        assert _greedy(llm, prompts) == vanilla
        after = spec_counters(llm)
        assert after["num_accepted_tokens"] > before["num_accepted_tokens"]
    finally:
        shutdown_llm(llm)
