"""Convert official Falcon (Bestpay-inc/Falcon) drafter checkpoints to falcon-vllm drafter dirs.

Official checkpoints are EAGLE-style: a ``pytorch_model.bin`` (or safetensors) holding
``embed_tokens.weight`` (a frozen copy of the target's, dropped here: we share the target's),
``lstm.weight_ih_l{0,1}`` / ``weight_hh`` / biases, and ``layers.N.*`` Llama (or Qwen2, with q/k/v
biases) decoder layers; their ``config.json`` is a Llama/Qwen2 config plus ``k_mask``.  The
published drafters (model cards ``Bestpay-inc/Falcon-Qwen2.5-*``) are Qwen2.5 drafters.

``falcon-vllm convert --src <official dir or file> --out <dir> [--target <HF dir>]``
"""

from __future__ import annotations

import json
import os

import torch

from falcon_vllm.config import SUPPORTED_MODEL_TYPES, FalconConfig
from falcon_vllm.drafter import FalconDrafter, check_state_dict, load_state_dict_file


def _read_official(src: str) -> tuple[dict, dict | None]:
    """Return (state dict, official config dict or None) from a directory or a weights file."""
    if os.path.isdir(src):
        cfg = None
        if os.path.exists(os.path.join(src, "config.json")):
            with open(os.path.join(src, "config.json")) as f:
                cfg = json.load(f)
        return load_state_dict_file(src), cfg
    if not os.path.isfile(src):
        raise FileNotFoundError(f"falcon-vllm: convert: --src {src}: no such file or directory")
    try:
        if src.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(src), None
        return torch.load(src, map_location="cpu", weights_only=True), None
    except Exception as e:  # safetensors and torch raise several error types for a corrupt file
        raise ValueError(f"falcon-vllm: convert: {src} cannot be read ({type(e).__name__}: {e})") from None


def config_from_official(cfg: dict | None, state: dict, target_config=None, tree: str | None = None) -> FalconConfig:
    """Build our config from an official config.json, falling back to weight shapes and the target."""
    fusion = "lstm" if any(k.startswith("lstm.") for k in state) else "fc"
    found = [int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()]
    if not found:
        raise ValueError("falcon-vllm: convert: the checkpoint has no drafter layers (layers.N.*): it is not an "
                         "official Falcon drafter (a target model's weights are model.layers.N.*)")
    layers = 1 + max(found)
    src = dict(cfg or {})
    if target_config is not None:
        base = FalconConfig.from_target(target_config, num_layers=layers, fusion=fusion)
        d = base.to_hf_dict()
        d.update({k: v for k, v in src.items() if k in ("rms_norm_eps", "rope_theta")})
    else:
        if not src:
            raise ValueError("falcon-vllm: an official checkpoint without config.json needs --target to know its shapes")
        d = dict(src)
    d["num_hidden_layers"] = layers
    d.setdefault("attention_bias", any(k.endswith("q_proj.bias") for k in state))
    if any(k.endswith("q_proj.bias") for k in state):
        d["attention_bias"] = True
    k = int(src.get("k_mask", 2))
    d["falcon"] = {"k": k, "fusion": fusion, "fc_bias": "fc.bias" in state, "tree": tree,
                   "target": (FalconConfig.from_target(target_config).target if target_config is not None
                              else {"hidden_size": d["hidden_size"], "vocab_size": d["vocab_size"],
                                    "model_type": d.get("model_type")})}
    if d.get("model_type") not in SUPPORTED_MODEL_TYPES:
        d["model_type"] = "llama"
    return FalconConfig.from_hf_dict(d, source="official config")


def convert_official(src: str, out_dir: str, target_config=None, tree: str | None = None) -> FalconDrafter:
    state, cfg = _read_official(src)
    fc = config_from_official(cfg, state, target_config, tree)
    if target_config is not None:
        fc.check_target(target_config)
    model = FalconDrafter(fc)
    model.load_state_dict(check_state_dict(model, state, src))
    model.save_pretrained(out_dir)
    return model


def export_official(drafter: FalconDrafter, embed_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our drafter -> an official-layout state dict (with the target embedding copied in)."""
    out = {"embed_tokens.weight": embed_weight.detach().clone()}
    out.update({k: v.detach().clone() for k, v in drafter.state_dict().items()})
    return out


def add_arguments(p):
    p.add_argument("--src", required=True, help="official drafter directory or weights file")
    p.add_argument("--out", required=True, help="output falcon-vllm drafter directory")
    p.add_argument("--target", default=None, help="target HF directory (checks shapes, fills the config)")
    p.add_argument("--tree", default=None, help="default decoding tree to record in the config")


def main(args):
    target_config = None
    if args.target:
        from transformers import AutoConfig
        target_config = AutoConfig.from_pretrained(args.target)
    m = convert_official(args.src, args.out, target_config, args.tree)
    n = sum(p.numel() for p in m.parameters())
    print(f"wrote {args.out}: k={m.config.k} fusion={m.config.fusion} layers={m.config.num_layers} params={n:,}")
    return 0
