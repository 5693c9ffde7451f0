"""The offline serving model (benchmarks/serving_sim.py): its drafts and steps against the reference engine,
and the lookup policies' accounting against vLLM's own n-gram matcher."""

import os
import sys

import pytest
import torch

from falcon_vllm.reference import FalconReferenceEngine
from falcon_vllm.testing import context_llama, exact_drafter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import serving_sim  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("depth", [2, 4])
def test_chain_steps_are_the_reference_engines(depth):
    """A 1-layer drafter (its K/V does not depend on the mask, so serving's causal prefix and the reference's
    relaxed chunks agree) on a target it predicts only in part (the exact drafter, perturbed; its attention
    output on, so each block reads the K/V before it): the simulated steps accept exactly what the reference
    engine's rounds accept, round by round."""
    target = context_llama()
    drafter = exact_drafter(target, k=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        drafter.fc.weight.add_(torch.randn(drafter.fc.weight.shape, generator=g) * 0.15)
        w = drafter.layers[0].self_attn.o_proj.weight
        w.add_(torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5)
    prompt = [5, 9, 17, 3, 40, 41]
    eng = FalconReferenceEngine(target, drafter, f"chain-{depth}")
    res = eng.generate(prompt, max_new_tokens=48)
    accepted = res.accept_lengths
    assert 0 < sum(accepted) < depth * len(accepted)  # some drafts accepted, some not: the test can fail
    tokens = prompt + res.tokens
    with torch.no_grad():  # the target's final-norm states (fp32, as the reference engine's)
        feats = target.model(torch.tensor([tokens])).last_hidden_state[0]
    drafts = serving_sim.chain_drafts(drafter, torch.tensor(tokens), feats, len(prompt), depth)
    steps = serving_sim.walk(tokens, len(prompt), drafts, serving_sim.parse_policy(f"chain:{depth}", None), k=2)
    got = [s["accepted"] for s in steps]
    assert got[:-1] == accepted[:len(got) - 1]  # the last step may be cut by the end of the answer
    assert sum(s["accepted"] + 1 for s in steps) == len(res.tokens) - 1  # every token after the first
    assert all(s["passes"] == depth // 2 and s["rows"] == depth for s in steps)


def test_lookup_policy_accounting():
    """A periodic answer: vLLM's matcher finds every continuation, the adaptive length doubles 2 -> 4 -> 8 after
    whole acceptances, and a step that drafts with the drafter where nothing matches is charged its passes."""
    period = [7, 8, 9, 10, 11]
    tokens = [1, 2, 3] + period * 8
    start = 3
    pol = serving_sim.parse_policy("lookup:8:2:2", None)
    assert pol == {"lookup": (8, 2, 2, 4), "drafter": 2}
    wrong = {n: [0, 0] for n in range(len(tokens))}  # the drafter is always wrong
    steps = serving_sim.walk(tokens, start, wrong, pol, k=2)
    lookups = [s for s in steps if s["lookup"]]
    assert [s["rows"] for s in lookups[:3]] == [2, 4, 8]
    assert all(s["accepted"] == s["rows"] for s in lookups[:-1])
    assert all(s["passes"] == 1 for s in steps)  # the chunk pass runs on lookup steps too
    assert not steps[0]["lookup"] and steps[0]["accepted"] == 0  # no repeat yet at the first step
    assert sum(s["accepted"] + 1 for s in steps) == len(tokens) - 1 - start
    # vLLM's n-gram proposer alone: no drafter passes; chain alone: no lookup
    ng = serving_sim.walk(tokens, start, None, serving_sim.parse_policy("ngram:4", None))
    assert all(s["passes"] == 0 and s["rows"] <= 4 for s in ng)
    assert sum(s["accepted"] + 1 for s in ng) == len(tokens) - 1 - start
    s = serving_sim.summarise(ng, {"vanilla": 10.0, "overhead": 1.0, "pass": 5.0, "row": 0.5})
    rows = sum(x["rows"] for x in ng)
    assert s["est_speedup"] == pytest.approx(round((len(tokens) - 1 - start) * 10.0 / (len(ng) * 11.0 + 0.5 * rows), 3))


def test_falcon_policy_reads_serving_json():
    serving = {"num_speculative_tokens": 8, "falcon_tokens": 2, "lookup_tokens": 4, "prompt_lookup_min": 2,
               "prompt_lookup_max": 4}
    assert serving_sim.parse_policy("falcon", serving) == {"lookup": (8, 4, 2, 4), "drafter": 2}
    assert serving_sim.parse_policy("falcon", {"num_speculative_tokens": 3}) == {"lookup": None, "drafter": 3}
    with pytest.raises(SystemExit):
        serving_sim.parse_policy("falcon", None)
    with pytest.raises(SystemExit):
        serving_sim.parse_policy("tree:x", None)
