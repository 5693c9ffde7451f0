"""``falcon-vllm gen-prompts``: questions written by the target itself, a prompt source without a limit.

ShareGPT holds about 9k usable first prompts, and drafters of the EAGLE class train on 68k and more. An
instruct model given its chat template up to the start of a user turn writes a user's question (the
Magpie recipe, Xu et al. 2024): sampled at temperature 1, each seed gives another one. This command samples
such questions from the target, keeps those that end with the end-of-turn token (not cut short), are long
enough, are new and match no benchmark prompt, and writes them as ShareGPT-format JSON, which
``falcon-vllm gen-data --data FILE`` then answers greedily and featurizes like ShareGPT's own prompts.

A small target writes mostly chat-style questions; ``--leads FILE`` (one opening per line, e.g. "Write a
Python function", "Solve this math problem:") puts the openings' words at the start of the user turns, attempt
i the (i mod n)-th, and the target writes the rest: questions of the kinds of task a user serves.

Deterministic (attempt i is seeded ``seed + i``) and resumable: the file is rewritten after each chunk,
and a rerun continues after the last attempt it holds.  Never downloads anything.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from falcon_vllm.config import dir_name
from falcon_vllm.models import chat_ids

BENCHMARKS = ("mt-bench", "humaneval", "gsm8k")


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens before a first user message's text (system prompt, role header): the
    common prefix of two renderings that differ only in that text."""
    a = chat_ids(tokenizer, [{"role": "user", "content": "Alpha"}])
    b = chat_ids(tokenizer, [{"role": "user", "content": "Zulu"}])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if n == 0:
        raise ValueError("falcon-vllm: gen-prompts: the chat template renders no prefix before a user message")
    return a[:n]


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def benchmark_texts() -> set[str]:
    """Every turn of the installed benchmark sets, normalized (a question written here that equals one is
    dropped, so nothing evaluated on is trained on)."""
    from falcon_vllm.models import load_chat_prompts

    out = set()
    for name in BENCHMARKS:
        try:
            rows = load_chat_prompts(name)
        except FileNotFoundError:
            continue
        out |= {normalize(t) for r in rows for t in r["turns"]}
    return out


# a line that opens a chat turn: a role word alone, or followed by ":" or a code fence ("Assistant: ...",
# "Assistant```sql")
ROLE_LINE = re.compile(r"^\s*(assistant|user|system)\s*(:|```|$)", re.IGNORECASE | re.MULTILINE)


def question(tokenizer, ids: list[int], eos_ids, min_tokens: int) -> str | None:
    """The question a sample holds, or None: cut short (no end-of-turn token), too short, or holding other
    special tokens (a second turn begun inside it), as token ids or spelt out as text, or a line that opens a chat
    turn (a role word alone or followed by ":" or a code fence: the target answering inside the user turn)."""
    if not ids or ids[-1] not in eos_ids:
        return None
    body = ids[:-1]
    special = special_tokens(tokenizer)
    if len(body) < min_tokens or any(t in special for t in body):
        return None
    text = tokenizer.decode(body).strip()
    if any(s in text for s in special.values()) or ROLE_LINE.search(text):
        return None
    return text or None


def special_tokens(tokenizer) -> dict[int, str]:
    """id -> text of every special token: ``all_special_ids`` and the added tokens marked special (Qwen's
    ``<|im_start|>`` is only the latter)."""
    out = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    out.update(zip(tokenizer.all_special_ids, tokenizer.all_special_tokens))
    return out


def run(target_dir: str, out_path: str, num: int, max_tokens: int = 128, temperature: float = 1.0,
        seed: int = 0, min_tokens: int = 6, chunk: int = 512, backend: str = "vllm", model=None,
        tokenizer=None, leads: list[str] | None = None, gen_dtype: str = "float32") -> Path:
    """Write ``num`` questions to ``out_path`` (ShareGPT JSON: ``[{"id", "conversations": [human, gpt]}]``, the
    gpt turn empty: gen-data regenerates it).  ``leads``: openings of the user turns, attempt i begins with
    ``leads[i % len(leads)]`` (the question holds it).  ``gen_dtype``: the dtype vLLM samples in (a question is
    only a prompt: bf16 serves where the CPU has bf16 units).  Returns the path."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if temperature <= 0:
        raise ValueError("falcon-vllm: gen-prompts: --temperature must be > 0 (greedy sampling writes one question)")
    if num < 1:
        raise ValueError(f"falcon-vllm: gen-prompts: --num must be >= 1, got {num}")
    tok = tokenizer or AutoTokenizer.from_pretrained(target_dir)
    if tok.eos_token_id is None:
        raise ValueError("falcon-vllm: gen-prompts: the tokenizer has no end-of-turn (EOS) token")
    eos = {tok.eos_token_id}
    prefix = user_turn_prefix(tok)
    if leads is not None:
        leads = [ln.strip() for ln in leads if ln.strip()]
        if not leads:
            raise ValueError("falcon-vllm: gen-prompts: --leads holds no opening (one per line)")
    lead_ids = [tok.encode(ln, add_special_tokens=False) for ln in leads or [""]]
    banned = benchmark_texts()
    out = Path(out_path)
    rows = json.loads(out.read_text()) if out.exists() else []
    meta_path = out.with_suffix(out.suffix + ".meta.json")
    meta = {"target": dir_name(target_dir), "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed, "min_tokens": min_tokens}
    if leads:
        meta["leads"] = leads
    if gen_dtype != "float32":
        meta["gen_dtype"] = gen_dtype
    if rows:  # resume: the same settings, after the last attempt the file holds
        check_settings(out_path, meta_path, meta)
    meta_path.write_text(json.dumps(meta, indent=1))
    attempt = max((int(r["id"].rsplit("-", 1)[1]) + 1 for r in rows), default=0)
    seen = {normalize(r["conversations"][0]["value"]) for r in rows}
    generate = sampler(backend, target_dir, model, tok, len(prefix) + max(map(len, lead_ids)) + max_tokens, gen_dtype)
    bar = tqdm(total=num, initial=min(len(rows), num), desc=f"gen-prompts ({backend})", unit="question")
    dropped = {"cut short or special": 0, "repeat": 0, "benchmark": 0}
    t0 = time.time()
    try:
        while len(rows) < num:
            n = max(1, min(chunk, 2 * (num - len(rows))))
            seeds = [seed + attempt + i for i in range(n)]
            heads = [lead_ids[(attempt + i) % len(lead_ids)] for i in range(n)]
            samples = generate([prefix + h for h in heads], max_tokens, temperature=temperature, seeds=seeds)
            for i, head, ids in zip(seeds, heads, samples):
                if len(rows) >= num:
                    break
                text = question(tok, head + list(ids), eos, min_tokens)
                key = normalize(text) if text else None
                reason = ("cut short or special" if key is None else "benchmark" if key in banned
                          else "repeat" if key in seen else None)
                if reason:
                    dropped[reason] += 1
                    continue
                seen.add(key)
                rows.append({"id": f"self-{i - seed}", "conversations": [{"from": "human", "value": text},
                                                                        {"from": "gpt", "value": ""}]})
                bar.update(1)
            attempt += n
            write_rows(out, rows)
            bar.set_postfix(attempts=attempt, q_per_s=f"{bar.n / max(time.time() - t0, 1e-9):.1f}")
    finally:
        bar.close()
        if hasattr(generate, "close"):
            generate.close()
    print(f"falcon-vllm: gen-prompts: {len(rows)} questions after {attempt} attempts (dropped this run: "
          + ", ".join(f"{v} {k}" for k, v in dropped.items()) + ")")
    return out


def check_settings(out_path: str, meta_path: Path, meta: dict) -> None:
    """A questions file is resumed with the settings it was written with (``meta``, kept in ``meta_path``)."""
    old = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    diff = [f"{k} {old.get(k)!r} (this run: {meta.get(k)!r})" for k in {**old, **meta}
            if old.get(k) != meta.get(k)]  # both ways: a file written with leads, resumed without, too
    if diff:
        raise ValueError(f"falcon-vllm: gen-prompts: {out_path} was written with other settings: "
                         + ", ".join(diff) + "; use the same ones or a new output file")


def write_rows(out: Path, rows: list[dict]) -> None:
    """Write the questions file whole (one row a line), replacing the one before only once it is written."""
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n]\n")
    os.replace(tmp, out)


def sampler(backend: str, target_dir: str, model, tok, max_model_len: int, gen_dtype: str = "float32"):
    """The sampling function of ``backend``: ``(prompts, max_new_tokens, temperature=, seeds=) -> token lists``
    (vLLM's in-process engine for sequences of up to ``max_model_len`` tokens, in ``gen_dtype``, or HF
    ``generate``, fp32 only)."""
    if backend == "vllm":
        from falcon_vllm.vllm.generate import VLLMGenerator  # only falcon_vllm.vllm imports vllm

        return VLLMGenerator(target_dir, max_model_len, dtype=gen_dtype)
    if gen_dtype != "float32":
        raise ValueError(f"falcon-vllm: gen-prompts: --gen-dtype {gen_dtype} needs --backend vllm")
    if backend == "hf":
        return hf_sampler(target_dir, model, tok)
    raise ValueError(f"falcon-vllm: gen-prompts: backend must be 'vllm' or 'hf', got {backend!r}")


def hf_sampler(target_dir, model, tok):
    """Sampled continuations with HF ``generate``, one request at a time (each with its own seed, so a sample
    does not depend on its batch): for machines without vLLM; slow."""
    import torch
    from transformers import AutoModelForCausalLM

    from falcon_vllm.train.gen_data import cut_after_eos

    mdl = model or AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(prompts, max_new_tokens, temperature, seeds):
        outs = []
        for p, s in zip(prompts, seeds):
            torch.manual_seed(int(s))
            ids = torch.tensor([p])
            o = mdl.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
            outs.append(cut_after_eos(o[0, len(p):].tolist(), {tok.eos_token_id}))
        return outs

    return generate


def add_arguments(p):
    p.add_argument("--target", default=None, help="target HF dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output JSON file (ShareGPT format; resumable)")
    p.add_argument("--num", type=int, default=1024, help="questions to write")
    p.add_argument("--max-tokens", type=int, default=128, help="a longer question is dropped as cut short")
    p.add_argument("--min-tokens", type=int, default=6, help="a shorter question is dropped")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="attempt i is sampled with seed SEED + i")
    p.add_argument("--backend", choices=["vllm", "hf"], default="vllm",
                   help="an in-process vLLM engine (continuous batching) or HF generate (slow)")
    p.add_argument("--leads", default=None,
                   help="text file, one opening per line (e.g. 'Write a Python function'): attempt i's user turn "
                        "begins with the (i mod n)-th and the target writes the rest")
    p.add_argument("--gen-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the dtype vLLM samples the questions in (bf16 is faster on CPUs with bf16 units)")
    p.add_argument("--chunk", type=int, default=512,
                   help="attempts per engine call; the file is written after each (the unit an interruption "
                        "loses: smaller for a slow target)")


def main(args):
    from falcon_vllm.models import model_path

    target = args.target or str(model_path())
    leads = Path(args.leads).read_text().splitlines() if args.leads else None
    if args.chunk < 1:
        raise SystemExit(f"falcon-vllm: gen-prompts: --chunk must be >= 1, got {args.chunk}")
    out = run(target, args.out, args.num, args.max_tokens, args.temperature, args.seed, args.min_tokens,
              chunk=args.chunk, backend=args.backend, leads=leads, gen_dtype=args.gen_dtype)
    print(f"wrote {out}; answer it with `falcon-vllm gen-data --data {out} --num-conversations 0 --out DIR`")
    return 0
