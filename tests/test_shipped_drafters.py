"""Every drafter shipped in falcon_vllm/drafters/: small enough to ship, readable, documented, and resolvable for its
recorded target (no target weights needed: the shapes it was trained for are recorded in its config)."""

import json

import pytest

from falcon_vllm.vllm.options import SERVING_FILE, check_weights, shipped_drafters

MAX_BYTES = 60_000_000  # a shipped drafter's committed weights: at most 60 MB


@pytest.mark.parametrize("drafter", shipped_drafters(), ids=lambda p: p.name)
def test_shipped_drafter_is_small_readable_and_documented(drafter):
    weights = drafter / "model.safetensors"
    assert weights.stat().st_size <= MAX_BYTES, f"{drafter.name}: {weights.stat().st_size} bytes"
    check_weights(str(drafter))  # the safetensors header opens
    assert (drafter / "README.md").read_text().startswith("# "), f"{drafter.name} has no model card"
    text = (drafter / "config.json").read_text()
    json.loads(text)
    assert '"/' not in text, f"{drafter.name}/config.json names a machine path"


@pytest.mark.parametrize("drafter", [d for d in shipped_drafters() if (d / SERVING_FILE).exists()],
                         ids=lambda p: p.name)
def test_shipped_falcon_drafter_resolves_for_its_recorded_target(drafter):
    """``"model": "falcon"`` picks this drafter for a target with the recorded shapes, and its serving.json reads."""
    from types import SimpleNamespace

    from falcon_vllm.config import FalconConfig
    from falcon_vllm.schema import read_serving
    from falcon_vllm.vllm.options import resolve_drafter

    t = FalconConfig.load(str(drafter)).target
    target = SimpleNamespace(**{k: v for k, v in t.items() if k != "name"})
    assert resolve_drafter("falcon", target) == str(drafter)
    read_serving(str(drafter / SERVING_FILE))
    check_weights(str(drafter), FalconConfig.load(str(drafter)))  # every tensor's name and shape match the config


def test_a_recorded_target_is_named_by_its_directory_not_its_path():
    from types import SimpleNamespace

    from falcon_vllm.config import target_signature

    cfg = SimpleNamespace(model_type="qwen2", hidden_size=8, vocab_size=16, num_hidden_layers=2,
                          _name_or_path="/opt/models/qwen2.5-coder-1.5b-instruct-float32/")
    assert target_signature(cfg)["name"] == "qwen2.5-coder-1.5b-instruct-float32"
