#!/usr/bin/env python
"""End-to-end benchmark: vanilla decoding vs Falcon vs its peers, same prompts, same process.

Methods (``--methods``):
  vanilla          vLLM, no speculation (the baseline of every vLLM row)
  falcon-chain     vLLM, ``{"method": "falcon"}`` with the Falcon drafter, K = --num-spec-tokens
  eagle            vLLM's built-in ``{"method": "eagle"}`` with the EAGLE-1 baseline drafter
  ngram            vLLM prompt lookup (the paper's PLD), K = --num-spec-tokens
  ref-vanilla      transformers greedy ``generate`` (the baseline of every reference row)
  ref-falcon-tree  falcon_vllm.reference engine with the decoding tree --tree (batch 1)
  ref-falcon-chain falcon_vllm.reference engine with a chain of K tokens

Metrics: tau = mean tokens committed per verification step incl. the bonus token (vLLM's "mean
acceptance length", from the engine's spec-decode counters; the paper's tau excludes the bonus:
``tau_excl_bonus``), alpha = accepted draft tokens / generated tokens, tokens/s of the timed
generation, speedup = tokens/s over the baseline of the same engine on the same prompts in this
run.  ``greedy_identical`` compares every method's tokens with its baseline's (null when sampling).

Stable numbers on a small CPU: one process, engines run one after another (never concurrently),
a warm-up generation per engine, ``enforce_eager``, fp32, batch 1 timed per request, and nothing
else running on the machine; repeats (``--repeats``) give the spread.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VLLM_METHODS = ("vanilla", "falcon-chain", "eagle", "ngram")
REF_METHODS = ("ref-vanilla", "ref-falcon-tree", "ref-falcon-chain")


def machine() -> str:
    import torch
    cpu = platform.processor() or "cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    try:
        import vllm
        vv = vllm.__version__
    except Exception:
        vv = "n/a"
    return f"{gpu or cpu} ({os.cpu_count()} cores), torch {torch.__version__}, vllm {vv}"


def spec_metrics(llm) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] = m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = list(m.values)
    return out


def metric_delta(before: dict, after: dict, generated: int) -> dict:
    """tau / alpha / per-position acceptance from two counter snapshots (engine counters, not estimates)."""
    drafts = after["drafts"] - before["drafts"]
    acc = after["accepted"] - before["accepted"]
    pp = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0) for i, a in enumerate(after["per_pos"])]
    return {"tau": 1 + acc / drafts if drafts else 1.0, "tau_excl_bonus": acc / drafts if drafts else 0.0,
            "alpha": acc / generated if generated else 0.0,
            "per_position_acceptance": [x / drafts for x in pp] if drafts else []}


def chat_prompt(tok, turns: list[str], answers: list[str]) -> list[int]:
    msgs = []
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run_conversations(gen_fn, tok, questions, batch_size: int):
    """Generate every turn of every question; returns (per-question token lists, seconds, tokens)."""
    answers = [[] for _ in questions]
    tokens = [[] for _ in questions]
    seconds, n = 0.0, 0
    max_turns = max(len(q["turns"]) for q in questions)
    for turn in range(max_turns):
        idx = [i for i, q in enumerate(questions) if len(q["turns"]) > turn]
        for b in range(0, len(idx), batch_size):
            chunk = idx[b:b + batch_size]
            prompts = [chat_prompt(tok, questions[i]["turns"][:turn + 1], answers[i]) for i in chunk]
            t0 = time.perf_counter()
            outs = gen_fn(prompts)
            seconds += time.perf_counter() - t0
            for i, o in zip(chunk, outs):
                tokens[i].append(o)
                answers[i].append(tok.decode(o, skip_special_tokens=True))
                n += len(o)
    return tokens, seconds, n


def vllm_engine(method: str, args):
    from vllm import LLM

    spec = None
    if method == "falcon-chain":
        if not args.drafter or not os.path.exists(os.path.join(args.drafter, "config.json")):
            return None, f"no Falcon drafter at {args.drafter!r}"
        spec = {"method": "falcon", "model": args.drafter, "num_speculative_tokens": args.num_spec_tokens}
    elif method == "eagle":
        if not args.eagle_drafter or not os.path.exists(os.path.join(args.eagle_drafter, "config.json")):
            return None, f"no EAGLE drafter at {args.eagle_drafter!r}"
        spec = {"method": "eagle", "model": args.eagle_drafter, "num_speculative_tokens": args.num_spec_tokens}
    elif method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.num_spec_tokens, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
    llm = LLM(model=args.model, dtype="float32", max_model_len=args.max_model_len, enforce_eager=True,
              max_num_seqs=max(1, args.batch_size), disable_log_stats=False, seed=0, speculative_config=spec)
    return llm, None


def free_engine(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def bench(args) -> list[dict]:
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from falcon_vllm.models import load_chat_prompts

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    data = {d: load_chat_prompts(d, args.num_prompts) for d in args.datasets}
    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    mach = machine()
    rows, tokens_by = [], {}
    methods = [m for m in args.methods]
    bar = tqdm(total=len(methods) * len(args.datasets), desc="bench", unit="run")
    for method in methods:
        if method in VLLM_METHODS:
            from vllm import SamplingParams
            llm, why = vllm_engine(method, args)
            if llm is None:
                print(f"[bench] skipping {method}: {why}", file=sys.stderr)
                bar.update(len(args.datasets))
                continue
            sp = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)

            def gen(prompts, llm=llm, sp=sp):
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
                return [list(o.outputs[0].token_ids) for o in outs]
        else:
            llm = None
            gen = reference_generator(method, args)
            if gen is None:
                bar.update(len(args.datasets))
                continue
        for ds in args.datasets:
            tps_list, m = [], {}
            for rep in range(args.repeats):
                before = spec_metrics(llm) if llm is not None else None
                if llm is None:
                    gen.stats.clear()
                toks, secs, n = run_conversations(gen, tok, data[ds], args.batch_size)
                tps_list.append(n / secs)
                if llm is not None:
                    m = metric_delta(before, spec_metrics(llm), n)
                else:
                    m = gen.metrics(n)
            tokens_by[(method, ds)] = toks
            base = "vanilla" if method in VLLM_METHODS else "ref-vanilla"
            row = {"method": method, "dataset": ds, "model": os.path.basename(args.model.rstrip("/")),
                   "drafter": (os.path.basename(args.drafter.rstrip("/")) if "falcon" in method and args.drafter
                               else os.path.basename(args.eagle_drafter.rstrip("/")) if method == "eagle" else None),
                   "engine": "vllm" if method in VLLM_METHODS else "reference",
                   "batch_size": args.batch_size if method in VLLM_METHODS else 1,
                   "temperature": args.temperature, "num_prompts": len(data[ds]), "generated_tokens": n,
                   "tau": round(m.get("tau", 1.0), 4), "tau_excl_bonus": round(m.get("tau_excl_bonus", 0.0), 4),
                   "alpha": round(m.get("alpha", 0.0), 4),
                   "per_position_acceptance": [round(x, 4) for x in m.get("per_position_acceptance", [])],
                   "tokens_per_s": round(statistics.median(tps_list), 3),
                   "tokens_per_s_min": round(min(tps_list), 3), "tokens_per_s_max": round(max(tps_list), 3),
                   "repeats": args.repeats, "speedup_vs_vanilla": None, "greedy_identical": None,
                   "baseline": base, "command": command, "machine": mach}
            if method == base:
                row["speedup_vs_vanilla"] = 1.0
                row["greedy_identical"] = True if args.temperature == 0 else None
            elif (base, ds) in tokens_by:
                b = next(r for r in rows if r["method"] == base and r["dataset"] == ds)
                row["speedup_vs_vanilla"] = round(row["tokens_per_s"] / b["tokens_per_s"], 3)
                if args.temperature == 0:
                    row["greedy_identical"] = toks == tokens_by[(base, ds)]
            rows.append(row)
            bar.update(1)
        if llm is not None:
            free_engine(llm)
    bar.close()
    return rows


class _RefGen:
    def __init__(self, fn, stats_fn):
        self.fn, self.stats, self._metrics = fn, [], stats_fn

    def __call__(self, prompts):
        return [self.fn(p) for p in prompts]

    def metrics(self, n):
        return self._metrics(self.stats, n)


def reference_generator(method: str, args):
    import torch
    from transformers import AutoModelForCausalLM

    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.reference import FalconReferenceEngine

    target = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if method == "ref-vanilla":
        def fn(p):
            x = torch.tensor([p])
            with torch.inference_mode():
                o = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
            return o[0, len(p):].tolist()
        return _RefGen(fn, lambda stats, n: {"tau": 1.0, "tau_excl_bonus": 0.0, "alpha": 0.0})
    if not args.drafter or not os.path.exists(os.path.join(args.drafter, "config.json")):
        print(f"[bench] skipping {method}: no Falcon drafter at {args.drafter!r}", file=sys.stderr)
        return None
    d = FalconDrafter.from_pretrained(args.drafter, target.config)
    tree = args.tree if method == "ref-falcon-tree" else f"chain-{args.num_spec_tokens}"
    eng = FalconReferenceEngine(target, d, tree)
    gen = None

    def fn(p):
        r = eng.generate(p, args.max_new_tokens, temperature=args.temperature, seed=0)
        gen.stats.extend(r.accept_lengths)
        return r.tokens

    def metrics(stats, n):
        depth = eng.tree.max_depth
        per = [sum(a > i for a in stats) / len(stats) for i in range(depth)] if stats else []
        return {"tau": 1 + sum(stats) / max(1, len(stats)), "tau_excl_bonus": sum(stats) / max(1, len(stats)),
                "alpha": sum(stats) / n if n else 0.0, "per_position_acceptance": per}

    gen = _RefGen(fn, metrics)
    return gen


def write_results(rows: list[dict], out_dir: str, name: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    cols = ["method", "engine", "dataset", "num_prompts", "generated_tokens", "tau", "tau_excl_bonus", "alpha",
            "tokens_per_s", "speedup_vs_vanilla", "greedy_identical"]
    lines = [f"# {name}", "", f"Command: `{rows[0]['command']}`" if rows else "", "",
             f"Machine: {rows[0]['machine']}" if rows else "", "",
             "tau includes the bonus token (vLLM's mean acceptance length); the Falcon paper reports "
             "tau_excl_bonus. Speedup is over the same engine's vanilla run (vLLM rows: `vanilla`; reference "
             "rows: `ref-vanilla`) on the same prompts in this run.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    methods = list(dict.fromkeys(r["method"] for r in rows))
    dsets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        for ax, key in zip(axes, ("speedup_vs_vanilla", "tau")):
            vals = [next((r[key] or 0 for r in rows if r["method"] == m and r["dataset"] == d), 0) for d in dsets]
            ax.bar([j + i * w for j in range(len(dsets))], vals, w, label=m)
    for ax, t in zip(axes, ("speedup vs vanilla (same engine)", "tau (incl. bonus)")):
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(dsets))], dsets)
        ax.set_title(t)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}_speedup.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in rows:
        if r["per_position_acceptance"] and r["dataset"] == dsets[0]:
            ax.plot(range(1, len(r["per_position_acceptance"]) + 1), r["per_position_acceptance"], marker="o",
                    label=r["method"])
    ax.set_xlabel("draft position / tree depth")
    ax.set_ylabel("acceptance rate")
    ax.set_title(f"per-position acceptance ({dsets[0]})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}_accept.png"), dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target HF dir (default: SmolLM2-135M-Instruct, converted offline)")
    p.add_argument("--drafter", default=None, help="Falcon drafter dir (default: the shipped SmolLM2 drafter)")
    p.add_argument("--eagle-drafter", default=None, help="EAGLE-1 drafter dir in vLLM's layout")
    p.add_argument("--methods", default="vanilla,falcon-chain,eagle,ngram,ref-vanilla,ref-falcon-tree")
    p.add_argument("--datasets", default="mt-bench,humaneval,gsm8k",
                   help="mt-bench (both turns), humaneval, gsm8k (first --num-prompts of the test set)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-spec-tokens", type=int, default=4)
    p.add_argument("--tree", default="falcon-llama")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--name", default="e2e")
    a = p.parse_args(argv)
    from falcon_vllm.models import model_path
    here = os.path.dirname(os.path.abspath(__file__))
    a.model = a.model or str(model_path())
    shipped = os.path.join(here, "..", "falcon_vllm", "drafters")
    a.drafter = a.drafter or os.path.normpath(os.path.join(shipped, "smollm2-135m-instruct"))
    a.eagle_drafter = a.eagle_drafter or os.path.normpath(os.path.join(shipped, "smollm2-135m-instruct-eagle"))
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    a.datasets = [d.strip() for d in a.datasets.split(",") if d.strip()]
    bad = [m for m in a.methods if m not in VLLM_METHODS + REF_METHODS]
    if bad:
        p.error(f"unknown methods {bad}; choose from {VLLM_METHODS + REF_METHODS}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = bench(args)
    write_results(rows, args.out_dir, args.name)
    for r in rows:
        print(f"{r['method']:17s} {r['dataset']:10s} tau={r['tau']:.2f} alpha={r['alpha']:.2f} "
              f"tok/s={r['tokens_per_s']:.1f} speedup={r['speedup_vs_vanilla']} identical={r['greedy_identical']}")
    print(f"wrote {os.path.join(args.out_dir, args.name)}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
