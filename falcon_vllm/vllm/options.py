"""Validate a ``{"method": "falcon", ...}`` speculative config and resolve its drafter.

Drafter resolution (``model`` missing, ``"falcon"``, or ``--speculative-model falcon``):
1. an explicit directory given as ``model``;
2. a drafter shipped in ``falcon_vllm/drafters/`` whose recorded target matches the served
   model (hidden size, vocabulary, number of layers, model type);
3. the directory in ``$FALCON_VLLM_DRAFTER``;
otherwise one error lists what was tried.
"""

from __future__ import annotations

import os
from pathlib import Path

from falcon_vllm.config import FalconConfig
from falcon_vllm.tree import build_tree

FALCON_KEYS = {"tree"}  # Falcon-only options, removed before vLLM validates the rest
DRAFTERS_DIR = Path(__file__).resolve().parent.parent / "drafters"


def _matches(cfg: FalconConfig, target_hf) -> bool:
    t = cfg.target or {}
    want = {"hidden_size": target_hf.hidden_size, "vocab_size": target_hf.vocab_size,
            "num_hidden_layers": getattr(target_hf, "num_hidden_layers", None),
            "model_type": getattr(target_hf, "model_type", None)}
    return all(t.get(k) == v for k, v in want.items() if t.get(k) is not None) and \
        cfg.hidden_size == target_hf.hidden_size and cfg.vocab_size == target_hf.vocab_size


def shipped_drafters() -> list[Path]:
    if not DRAFTERS_DIR.is_dir():
        return []
    return sorted(p for p in DRAFTERS_DIR.iterdir() if (p / "config.json").exists())


def resolve_drafter(model, target_hf) -> str:
    if model not in (None, "falcon"):
        return str(model)
    tried = []
    for d in shipped_drafters():
        try:
            cfg = FalconConfig.load(str(d))
        except (ValueError, FileNotFoundError):
            continue  # e.g. an EAGLE export in the same folder
        if _matches(cfg, target_hf):
            return str(d)
        tried.append(d.name)
    env = os.environ.get("FALCON_VLLM_DRAFTER")
    if env:
        return env
    raise ValueError(
        "falcon: no drafter for this target. Tried: (1) an explicit path ('model' / --speculative-model "
        f"<dir>): none given; (2) drafters shipped with falcon-vllm: {tried or 'none'} (none matches "
        f"hidden_size={target_hf.hidden_size}, vocab_size={target_hf.vocab_size}); (3) $FALCON_VLLM_DRAFTER: "
        "not set. Train one with `falcon-vllm train` or pass its directory.")


def check_weights(path: str) -> None:
    st, pt = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.exists(st):
        from safetensors import safe_open
        try:
            with safe_open(st, "pt") as f:
                f.keys()
        except Exception as e:
            raise ValueError(f"falcon: drafter weights {st} are corrupt or truncated ({e})") from None
    elif not os.path.exists(pt):
        raise ValueError(f"falcon: drafter directory {path!r} has no weights (model.safetensors)")


def resolve_falcon_config(sc: dict, target_hf, valid_keys: set[str]) -> tuple[dict, dict]:
    """Return (the config to give vLLM with method 'eagle', Falcon info to tag the draft config)."""
    sc = {k.replace("-", "_"): v for k, v in sc.items()}
    unknown = sorted(set(sc) - valid_keys - FALCON_KEYS)
    if unknown:
        raise ValueError(f"falcon: unknown option(s) {unknown} in the speculative config; Falcon options: "
                         f"{sorted(FALCON_KEYS)}, plus vLLM's: {sorted(valid_keys)}")
    path = resolve_drafter(sc.get("model"), target_hf)
    cfg = FalconConfig.load(path)  # clear errors: missing dir, no config.json, not a Falcon drafter
    cfg.check_target(target_hf)    # clear error: drafter for another hidden size / vocabulary
    check_weights(path)
    tree_spec = sc.pop("tree", None)
    n = sc.get("num_speculative_tokens")
    if tree_spec is not None:
        tree = build_tree(tree_spec, cfg.k)
        if not tree.is_chain:
            raise ValueError(f"falcon: tree {tree_spec!r} is not a chain; inside vLLM falcon runs in chain mode "
                             "(tree verification runs in the reference engine, falcon_vllm.reference)")
        if n is not None and n != tree.num_nodes:
            raise ValueError(f"falcon: num_speculative_tokens={n} disagrees with tree {tree_spec!r} "
                             f"({tree.num_nodes} tokens)")
        n = tree.num_nodes
    if n is None:
        n = 2 * cfg.k
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"falcon: num_speculative_tokens must be an integer >= 1, got {n!r}")
    sc.update(method="eagle", model=path, num_speculative_tokens=n)
    return sc, {"mode": "chain", "num_speculative_tokens": n}
