"""Reference engine on a real model: SmolLM2-135M-Instruct (fp32) on MT-Bench prompts."""

import os

import pytest
import torch

from falcon_vllm.drafter import FalconDrafter
from falcon_vllm.models import chat_ids, load_chat_prompts, model_path
from falcon_vllm.reference import FalconReferenceEngine
from falcon_vllm.testing import hf_greedy, random_drafter

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "falcon_vllm", "drafters", "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [chat_ids(tok, [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True)
               for q in load_chat_prompts("mt-bench", 3)]
    return model, prompts


@pytest.mark.parametrize("tree,k,drafter", [("falcon-llama", 2, "random"), ("chain-4", 2, "random"),
                                            ("falcon-llama", 2, "shipped"), ("eagle-small", 1, "random")])
def test_smollm2_greedy_equals_hf_generate(smollm, tree, k, drafter):
    model, prompts = smollm
    if drafter == "shipped":
        if not os.path.exists(os.path.join(SHIPPED, "model.safetensors")):
            pytest.skip("the shipped SmolLM2 drafter is not in the repository yet")
        d = FalconDrafter.from_pretrained(SHIPPED, model.config)
    else:
        d = random_drafter(model, k=k)
    eng = FalconReferenceEngine(model, d, tree)
    n = 24
    for p in prompts[:2]:
        r = eng.generate(list(p), n)
        assert r.tokens == hf_greedy(model, list(p), n)
