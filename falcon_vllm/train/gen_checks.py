"""gen-data's checks: options that do not go together, and a resumed directory written with other settings."""

from __future__ import annotations

import json
from pathlib import Path

from falcon_vllm.train.answer_files import GENERATION

# the manifest keys a resumed run must share with the run that wrote the directory: (key, flag, what a
# directory written before the key holds; None: not checked there)
RESUME_KEYS = (("generation", "--replies", GENERATION["target"]), ("aux_layers", "--aux-layers", []),
               ("featurizer", "--featurizer", "hf"), ("featurize_dtype", "--featurize-dtype", "float32"),
               ("target", "--target", None), ("hidden_size", "--target", None),
               ("skip_conversations", "--skip-conversations", None), ("max_new_tokens", "--max-new-tokens", None),
               ("max_turns", "--max-turns", None), ("loss_from_turn", "--loss-from-turn", None),
               ("max_total_tokens", "--max-total-tokens", None), ("max_prompt_tokens", "the prompt limit", None),
               ("shard_size", "--shard-size", None))


def check_options(max_turns: int, loss_from_turn: int, replies: str, answers: str | None, backend: str,
                  featurizer: str = "hf") -> None:
    """Refuse gen-data options that do not go together (before the target is loaded)."""
    if loss_from_turn < 1 or loss_from_turn > max_turns:
        raise ValueError(f"falcon-vllm: gen-data: --loss-from-turn must be in 1..--max-turns ({max_turns}), "
                         f"got {loss_from_turn}")
    if replies not in GENERATION:
        raise ValueError(f"falcon-vllm: gen-data: --replies must be 'target' or 'data', got {replies!r}")
    if replies == "data" and (max_turns != 1 or answers):
        raise ValueError("falcon-vllm: gen-data: --replies data featurizes the data's first replies only: "
                         "it takes neither --max-turns above 1 nor --answers")
    if backend not in ("hf", "vllm"):
        raise ValueError(f"falcon-vllm: gen-data: backend must be 'hf' or 'vllm', got {backend!r}")
    if featurizer not in ("hf", "vllm"):
        raise ValueError(f"falcon-vllm: gen-data: --featurizer must be 'hf' or 'vllm', got {featurizer!r}")
    if featurizer == "vllm" and backend != "vllm" and replies == "target":
        raise ValueError("falcon-vllm: gen-data: --featurizer vllm answers through vLLM: it takes no --backend hf")


def shards_written(out_dir: str, manifest: dict) -> list[dict]:
    """The manifest entries of the shards a run before wrote into ``out_dir`` (resume: their measured figures are
    kept), after checking that it wrote them with the same ``RESUME_KEYS`` settings as ``manifest``."""
    out = Path(out_dir)
    old = out / "manifest.json"
    if not old.exists():
        return []
    written = json.loads(old.read_text())
    for key, flag, before in RESUME_KEYS:
        was = written.get(key, before)
        if was is not None and key in manifest and was != manifest[key]:
            raise ValueError(f"falcon-vllm: gen-data: {out_dir} was written with other {flag} ({key} {was!r}, "
                             f"now {manifest[key]!r}); resume with the same ones or use a new --out")
    # "beyond": shards past the conversations of the last run (a run of fewer), kept for a run of more
    return [sh for sh in written.get("shards", []) + written.get("beyond", []) if readable_shard(out / sh["file"])]


def readable_shard(path: Path) -> bool:
    """Whether a shard file exists and its safetensors header reads (a truncated one is written again)."""
    if not path.exists():
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
        return True
    except Exception:  # safetensors raises several error types for a truncated file
        return False
