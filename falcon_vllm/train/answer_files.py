"""The answers file of ``falcon-vllm gen-data`` (``--save-answers FILE``, read back by ``--answers FILE``): every
conversation's tokens and loss mask, without hidden states (a few MB), with the generation settings as
metadata, so a later run featurizes those conversations instead of generating them again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


ANSWER_KEYS = ("target", "max_new_tokens", "max_turns", "max_total_tokens", "max_prompt_tokens",
               "skip_conversations", "loss_from_turn", "generation")
GENERATION = {"target": "greedy (self-distillation)", "data": "the data's own replies"}  # per --replies
ANSWER_DEFAULTS = {"loss_from_turn": "1", "generation": GENERATION["target"]}  # files from before the keys


def save_answers(out_dir: str, path: str, keep_longer: bool = False) -> int:
    """Write the token sequences and loss masks of a gen-data directory's shards (contiguous from the first;
    no hidden states) into one safetensors file, with the generation settings as metadata.  Returns the
    number of conversations written.  ``keep_longer``: a file at ``path`` that already holds more conversations
    than the directory (features being rebuilt from it) is left as it is (its count returned)."""
    from safetensors import safe_open

    man = json.loads(Path(out_dir, "manifest.json").read_text())
    if keep_longer and os.path.exists(path):
        held = int(answers_meta(path).get("conversations", 0))
        if held > sum(sh["conversations"] for sh in man["shards"]):
            return held
    toks, masks, offsets = [], [], [0]
    for i, sh in enumerate(sorted(man["shards"], key=lambda sh: sh["file"])):
        if sh["file"] != f"shard_{i:05d}.safetensors":
            break  # a gap: later shards are not contiguous with the file's conversation indices
        with safe_open(str(Path(out_dir, sh["file"])), "pt") as f:
            t, m, off = f.get_tensor("tokens"), f.get_tensor("loss_mask"), f.get_tensor("offsets")
        toks.append(t)
        masks.append(m)
        offsets += (off[1:] + offsets[-1]).tolist()
    meta = {k: str(man.get(k, ANSWER_DEFAULTS.get(k))) for k in ANSWER_KEYS}
    return write_answers(path, torch.cat(toks), torch.cat(masks), offsets, meta)


def write_answers(path: str, tokens, loss_mask, offsets: list[int], meta: dict) -> int:
    """Write an answers file atomically (a reader never sees half of one): the concatenated ``tokens`` and
    ``loss_mask``, conversation i at ``offsets[i]:offsets[i+1]``, and ``meta`` (the settings of ``ANSWER_KEYS``,
    anything else kept as is).  Returns the number of conversations."""
    from safetensors.torch import save_file

    meta = {**{k: str(v) for k, v in meta.items()}, "conversations": str(len(offsets) - 1)}
    tmp = path + ".tmp"
    save_file({"tokens": torch.as_tensor(tokens).to(torch.int32), "loss_mask": torch.as_tensor(loss_mask).to(torch.uint8),
               "offsets": torch.tensor(offsets, dtype=torch.int64)}, tmp, metadata=meta)
    os.replace(tmp, path)
    return len(offsets) - 1


def answers_meta(path: str) -> dict:
    """The metadata of an answers file (its settings and what its runs recorded)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return dict(f.metadata() or {})


def load_answers(path: str, expect: dict) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(tokens, loss mask) per conversation of a ``save_answers`` file and the turns it was generated with,
    after checking that it was generated with the settings in ``expect`` (clear error naming each difference).
    A file with fewer turns than ``expect`` (every turn trained) is accepted: its turns are continued."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            t, m, off = f.get_tensor("tokens"), f.get_tensor("loss_mask"), f.get_tensor("offsets")
    except Exception as e:  # missing file, corrupt header, missing tensor
        raise ValueError(f"falcon-vllm: gen-data: --answers {path} could not be read ({type(e).__name__}: {e})") from None
    meta = {**meta, **{k: v for k, v in ANSWER_DEFAULTS.items() if meta.get(k) in (None, "None")}}
    fewer = (meta.get("max_turns", "").isdigit() and int(meta["max_turns"]) < int(expect["max_turns"])
             and meta["loss_from_turn"] == "1")
    skip = ("max_turns", "loss_from_turn") if fewer else ()
    diff = [f"{k} {meta.get(k)!r} (this run: {str(expect[k])!r})" for k in ANSWER_KEYS
            if k not in skip and meta.get(k) != str(expect[k])]
    if diff:
        raise ValueError(f"falcon-vllm: gen-data: --answers {path} was generated with other settings: " + ", ".join(diff))
    off = off.tolist()
    return [(t[a:b].tolist(), m[a:b].tolist()) for a, b in zip(off[:-1], off[1:])], int(meta["max_turns"])
