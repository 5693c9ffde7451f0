#!/usr/bin/env python
"""Study: vanilla vs Falcon vs EAGLE, n-gram and draft-model, each engine on its own, one after another: tau and
speedup per method?

Answer: Falcon's lookup + chain 1.23x / 1.44x / 1.22x (tau 1.94 / 2.18 / 1.89, MT-Bench / HumanEval / GSM8K),
all greedy-identical; separate engines carry the machine's drift between them, so the same-process A/B
(ab_step.py, `falcon-vllm bench`) replaced this.
Result: benchmarks/results/e2e_smollm2_v6_batch1.md

End-to-end benchmark: vanilla decoding vs Falcon vs its peers, same prompts, one process.

Methods (``--methods``, comma separated; engines run one at a time, each freed before the next):
  vanilla            vLLM, no speculation: the baseline of every vLLM row on the same target
  falcon-chain       vLLM, ``{"method": "falcon"}`` with the Falcon drafter (--drafter), chain of
                     K = --num-spec-tokens tokens drafted in ceil(K/k) drafter passes
  falcon-lookup      vLLM, ``{"method": "falcon", ...}`` with prompt lookup first: a request whose tokens end
                     in a repeated n-gram (--ngram-min..--ngram-max) gets up to --ngram-spec-tokens looked-up
                     tokens, any other the drafter's chain of --num-spec-tokens
  falcon-tree[:<tree>]  vLLM, ``{"method": "falcon", "tree": <tree>}``: tree mode (preset name or a
                     tune-tree file; default --tree), verified in one target pass under the ancestor mask
  eagle              vLLM's built-in ``{"method": "eagle"}`` with the EAGLE baseline drafter
                     (--eagle-drafter), K = --eagle-spec-tokens
  ngram              vLLM prompt lookup (the paper's PLD): lookup n-grams --ngram-min..--ngram-max,
                     K = --ngram-spec-tokens
  draft-model        vLLM ``{"method": "draft_model"}``: Qwen2.5-Coder-1.5B-Instruct target with the
                     0.5B as draft (offline PyPI packages; skipped when they are not installed).  Its
                     baseline is a ``vanilla`` row of the 1.5B target run just before it.
  ref-vanilla        transformers greedy/sampled ``generate`` (batch 1): the baseline of reference rows
  ref-falcon-chain   falcon_vllm.reference engine, chain of K = --num-spec-tokens tokens (batch 1)
  ref-falcon-tree[:<tree>]  the reference engine with a decoding tree (preset name, default --tree)

A method whose plugin, drafter or model is missing is skipped with a message (listed in the
results) instead of failing the run; ``--strict`` turns that into an error.

Metrics (per method and dataset):
  tau             mean tokens committed per verification step, bonus token included (vLLM's "mean
                  acceptance length") = 1 + accepted / drafts, from deltas of the engine's
                  spec-decode counters (vLLM: ``LLM.get_metrics()``; reference: the engine's round
                  stats turned into the same counters).  Never estimated from token counts.
  tau_excl_bonus  the Falcon paper's tau (bonus excluded) = accepted / drafts
  alpha           accepted draft tokens / generated tokens
  tokens_per_s    generated tokens / wall time of the generate calls (prefill included, chat
                  templating excluded); median over --repeats, with std/min/max
  speedup_vs_vanilla  tokens_per_s / the baseline's tokens_per_s (same engine, same target, same
                  prompts, same run)
  greedy_identical    every prompt's tokens equal the baseline's (every repeat); null when sampling

Datasets: ``mt-bench`` (first --num-prompts questions, both turns as one conversation: the second
turn's prompt holds the first turn's generated answer, rendered with the chat template),
``humaneval`` (first --num-prompts problems, the prompt as the user message), ``gsm8k`` (first
--num-prompts questions of the test set, as the user message).  Prompts of one turn are submitted
--batch-size at a time (vLLM continuous batching); reference rows are always batch 1.

Stable numbers on a small shared CPU (what this script does, and what we found effective):
  * in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``enforce_eager=True``, fp32, prefix
    caching off (repeats and warm-ups would otherwise hit cached prefixes);
  * vLLM's CPU worker binds its OpenMP threads itself (``VLLM_CPU_OMP_THREADS_BIND=auto``: one
    thread per physical core minus one core reserved for the scheduler; on 2 cores: 1 thread on
    core 0) and blocks ``torch.set_num_threads`` afterwards.  Reference rows therefore run first,
    with ``torch.set_num_threads(--threads)`` (default: the same thread count vLLM's auto binding
    uses), so both engines use the same number of cores;
  * --warmup untimed generations per engine (--warmup-tokens long; also pays the ngram
    proposer's numba JIT and the first-call allocations), then --repeats timed passes over all prompts; the spread is in
    tokens_per_s_std/min/max.  Load from other processes shows up as spread: compare the rows of
    one run only.
  * ``LD_PRELOAD`` of Intel OpenMP (``libiomp5.so``, which vLLM recommends for CPU speculative
    decoding) must be set before Python starts; the machine string records whether it was.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields

from falcon_vllm.vllm.engine import COUNTERS, PER_POS, counter_delta, empty_counters, shutdown_llm, spec_counters

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness.machine import cpu_name  # noqa: E402
from harness.paths import RESULTS, ROOT, portable, portable_text  # noqa: E402

DRAFTERS = os.path.join(ROOT, "falcon_vllm", "drafters")
VLLM_METHODS = ("vanilla", "falcon-chain", "falcon-lookup", "falcon-tree", "eagle", "ngram", "draft-model")
REF_METHODS = ("ref-vanilla", "ref-falcon-chain", "ref-falcon-tree")
DRAFT_MODEL_TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT_MODEL_DRAFT = "qwen2.5-coder-0.5b-instruct"


@dataclass
class Row:
    """One result row, a method on a dataset: the columns of <name>.json, in this order (a row whose
    greedy tokens differ from the baseline's gets a "first_mismatch" entry after them)."""
    method: str
    engine: str
    dataset: str
    model: str | None
    drafter: str | None
    num_spec_tokens: int | None
    tree: str | None
    batch_size: int
    temperature: float
    num_prompts: int
    num_generations: int
    max_new_tokens: int
    generated_tokens: int
    tau: float
    tau_excl_bonus: float
    alpha: float
    draft_acceptance_rate: float | None
    per_position_acceptance: list[float]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    tokens_per_s: float
    tokens_per_s_std: float
    tokens_per_s_min: float
    tokens_per_s_max: float
    repeats: int
    warmup: int
    seconds: list[float]
    speedup_vs_vanilla: float | None
    baseline: str
    greedy_identical: bool | None
    deterministic_across_repeats: bool | None
    command: str
    machine: str


ROW_FIELDS = tuple(f.name for f in fields(Row))


class Skip(Exception):
    """A method cannot run here (missing plugin, drafter or model); the reason is reported."""


# ----------------------------------------------------------------------------------------- metrics
def add_rounds(counters: dict, accepted: list[int], nodes: list[int], depth: int) -> None:
    """Fold reference-engine rounds (accepted draft tokens, verified nodes) into vLLM-style counters."""
    pp = counters[PER_POS] + [0] * max(0, depth - len(counters[PER_POS]))
    for a, n in zip(accepted, nodes):
        counters["num_drafts"] += 1
        counters["num_draft_tokens"] += n
        counters["num_accepted_tokens"] += a
        for i in range(min(a, depth)):
            pp[i] += 1
    counters[PER_POS] = pp


def metrics_from_counters(before: dict, after: dict, generated: int) -> dict:
    """tau / alpha / per-position acceptance from two counter snapshots (deltas of engine counters).

    ``generated`` is the number of tokens generated between the two snapshots.  Without drafts
    (vanilla) tau is 1 and nothing is accepted.
    """
    d = counter_delta(after, before)
    drafts, draft_tokens, acc, pp = (d[k] for k in (*COUNTERS, PER_POS))
    if min([drafts, draft_tokens, acc] + pp, default=0) < 0:
        raise ValueError("falcon-vllm: spec-decode counters went backwards: snapshots from different engines?")
    return {"tau": 1.0 + acc / drafts if drafts else 1.0,
            "tau_excl_bonus": acc / drafts if drafts else 0.0,
            "alpha": acc / generated if generated else 0.0,
            "draft_acceptance_rate": acc / draft_tokens if draft_tokens else None,
            "per_position_acceptance": [x / drafts for x in pp] if drafts else [],
            "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": acc}


# ------------------------------------------------------------------------------------------ prompts
def chat_prompt(tok, turns: list[str], answers: list[str]) -> list[int]:
    from falcon_vllm.models import chat_ids

    msgs = []
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    return chat_ids(tok, msgs, add_generation_prompt=True)


def run_conversations(generate, tok, questions: list[dict], batch_size: int):
    """Generate every turn of every question (turn t+1 sees the answer to turn t).

    Returns (tokens[question][turn], seconds spent in ``generate``, generated token count).
    """
    answers = [[] for _ in questions]
    tokens = [[] for _ in questions]
    seconds, n = 0.0, 0
    for turn in range(max(len(q["turns"]) for q in questions)):
        idx = [i for i, q in enumerate(questions) if len(q["turns"]) > turn]
        for b in range(0, len(idx), batch_size):
            chunk = idx[b:b + batch_size]
            prompts = [chat_prompt(tok, questions[i]["turns"][:turn + 1], answers[i]) for i in chunk]
            t0 = time.perf_counter()
            outs = generate(prompts)
            seconds += time.perf_counter() - t0
            for i, o in zip(chunk, outs):
                tokens[i].append(list(o))
                answers[i].append(tok.decode(o, skip_special_tokens=True))
                n += len(o)
    return tokens, seconds, n


# ---------------------------------------------------------------------------------------- runners
def _has_config(d) -> bool:
    return bool(d) and os.path.isfile(os.path.join(d, "config.json"))


def _short(path) -> str | None:
    return os.path.basename(str(path).rstrip("/")) if path else None


class VllmRunner:
    engine = "vllm"

    def __init__(self, method: str, args, model: str | None = None):
        self.method, self.args = method, args
        self.model = model or args.model
        self.drafter, self.num_spec_tokens, self.tree, self.spec = None, None, None, None
        a = args
        if method == "falcon-chain":
            self._plugin_check()
            if not _has_config(a.drafter):
                raise Skip(f"no Falcon drafter at {a.drafter!r} (config.json missing)")
            self.drafter, self.num_spec_tokens = a.drafter, a.num_spec_tokens
            self.spec = {"method": "falcon", "model": a.drafter, "num_speculative_tokens": a.num_spec_tokens}
        elif method == "falcon-lookup":
            self._plugin_check()
            if not _has_config(a.drafter):
                raise Skip(f"no Falcon drafter at {a.drafter!r} (config.json missing)")
            K = max(a.ngram_spec_tokens, a.num_spec_tokens)
            self.drafter, self.num_spec_tokens = a.drafter, K
            self.spec = {"method": "falcon", "model": a.drafter, "num_speculative_tokens": K,
                         "falcon_tokens": a.num_spec_tokens, "prompt_lookup_min": a.ngram_min,
                         "prompt_lookup_max": a.ngram_max}
        elif method.partition(":")[0] == "falcon-tree":
            self._plugin_check()
            if not _has_config(a.drafter):
                raise Skip(f"no Falcon drafter at {a.drafter!r} (config.json missing)")
            self.tree = method.partition(":")[2] or a.tree
            self.drafter = a.drafter
            self.spec = {"method": "falcon", "model": a.drafter, "tree": self.tree}
            from falcon_vllm.config import FalconConfig
            from falcon_vllm.tree import build_tree
            built = build_tree(self.tree, FalconConfig.load(a.drafter).k)
            # vLLM counts acceptance per speculative-token position; for a tree, position i = depth i + 1
            self.num_spec_tokens, self.depth = built.num_nodes, built.max_depth
            self.tree = portable(self.tree)
        elif method == "eagle":
            if not _has_config(a.eagle_drafter):
                raise Skip(f"no EAGLE drafter at {a.eagle_drafter!r} (config.json missing)")
            self.drafter, self.num_spec_tokens = a.eagle_drafter, a.eagle_spec_tokens
            self.spec = {"method": "eagle", "model": a.eagle_drafter, "num_speculative_tokens": a.eagle_spec_tokens}
        elif method == "ngram":
            self.num_spec_tokens = a.ngram_spec_tokens
            self.drafter = f"ngram[{a.ngram_min}-{a.ngram_max}]"
            self.spec = {"method": "ngram", "num_speculative_tokens": a.ngram_spec_tokens,
                         "prompt_lookup_min": a.ngram_min, "prompt_lookup_max": a.ngram_max}
        elif method == "draft-model":
            self.drafter, self.num_spec_tokens = model_dir(DRAFT_MODEL_DRAFT), a.draft_model_spec_tokens
            self.spec = {"method": "draft_model", "model": self.drafter,
                         "num_speculative_tokens": a.draft_model_spec_tokens}
        self.llm = None

    @staticmethod
    def _plugin_check():
        import importlib.metadata
        import importlib.util
        if importlib.util.find_spec("falcon_vllm.vllm") is None:
            raise Skip("the falcon vLLM plugin (falcon_vllm.vllm) is not installed")
        eps = importlib.metadata.entry_points(group="vllm.general_plugins")
        if not any(ep.value.startswith("falcon_vllm") for ep in eps):
            raise Skip("the falcon vLLM plugin is not registered (vllm.general_plugins entry point missing; "
                       "`pip install -e .`)")

    def start(self):
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tok = AutoTokenizer.from_pretrained(self.model)
        a = self.args
        try:
            self.llm = LLM(model=self.model, dtype="float32", max_model_len=a.max_model_len, enforce_eager=True,
                           max_num_seqs=max(1, a.batch_size), disable_log_stats=False, seed=0,
                           enable_prefix_caching=a.prefix_caching, speculative_config=self.spec)
        except Exception as e:  # a drafter/plugin that vLLM rejects: report, do not hide
            _shutdown(None)
            if a.strict:
                raise
            raise Skip(f"vLLM engine failed to start: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from e

    def generate(self, prompts, max_new_tokens=None):
        from vllm import SamplingParams
        sp = SamplingParams(max_tokens=max_new_tokens or self.args.max_new_tokens, temperature=self.args.temperature, seed=0)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def counters(self):
        return spec_counters(self.llm)

    def close(self):
        _shutdown(self.llm)
        self.llm = None


def _shutdown(llm):
    """Shut an engine down (None: one that failed to start); a clean-up that fails does not stop the run."""
    try:
        shutdown_llm(llm)
    except Exception:
        pass


_TARGETS: dict = {}


class RefRunner:
    engine = "reference"

    def __init__(self, method: str, args):
        self.method, self.args = method, args
        self.model = args.model
        base, _, tree = method.partition(":")
        self.kind = base
        self.drafter, self.num_spec_tokens, self.tree = None, None, None
        if base != "ref-vanilla":
            if not _has_config(args.drafter):
                raise Skip(f"no Falcon drafter at {args.drafter!r} (config.json missing)")
            self.drafter = args.drafter
            self.tree = (tree or args.tree) if base == "ref-falcon-tree" else f"chain-{args.num_spec_tokens}"
        self._counters = empty_counters()

    def start(self):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(self.model)
        self.eos = self.tok.eos_token_id
        if self.model not in _TARGETS:
            _TARGETS.clear()
            _TARGETS[self.model] = AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.float32).eval()
        self.target = _TARGETS[self.model]
        if self.kind != "ref-vanilla":
            from falcon_vllm.drafter import FalconDrafter
            from falcon_vllm.reference import FalconReferenceEngine
            d = FalconDrafter.from_pretrained(self.drafter, self.target.config).eval()
            self.eng = FalconReferenceEngine(self.target, d, self.tree)
            self.num_spec_tokens = self.eng.tree.num_nodes
            self.depth = self.eng.tree.max_depth
        self.calls = 0

    def generate(self, prompts, max_new_tokens=None):
        import torch
        a = self.args
        max_new = max_new_tokens or a.max_new_tokens
        out = []
        for p in prompts:
            self.calls += 1
            if self.kind == "ref-vanilla":
                x = torch.tensor([p])
                kw = dict(do_sample=False) if a.temperature == 0 else dict(
                    do_sample=True, temperature=a.temperature, top_k=None, top_p=1.0)
                if a.temperature > 0:
                    torch.manual_seed(self.calls)
                with torch.inference_mode():
                    o = self.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                             eos_token_id=self.eos, pad_token_id=self.eos, **kw)
                out.append(o[0, len(p):].tolist())
            else:
                r = self.eng.generate(p, max_new, temperature=a.temperature, eos_token_id=self.eos,
                                      seed=self.calls)
                add_rounds(self._counters, [x.accepted for x in r.rounds], [x.tree_nodes for x in r.rounds],
                           self.depth)
                out.append(list(r.tokens))
        return out

    def counters(self):
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self._counters.items()}

    def close(self):
        self.eng = None
        gc.collect()


def model_dir(name: str) -> str:
    from falcon_vllm.models import model_path
    try:
        return str(model_path(name))
    except (FileNotFoundError, ValueError) as e:
        raise Skip(str(e).splitlines()[0]) from e


# -------------------------------------------------------------------------------------- machine
def machine(args) -> str:
    import torch

    versions = [f"torch {torch.__version__}"]
    for mod in ("vllm", "transformers"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            versions.append(f"{mod} n/a")
    if torch.cuda.is_available():
        hw = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        hw = cpu_name()
    pre = os.path.basename(os.environ.get("LD_PRELOAD", "")) or "none"
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return (f"{hw}, {', '.join(versions)}; reference threads {args.threads}, VLLM_CPU_OMP_THREADS_BIND={bind}, "
            f"LD_PRELOAD={pre}")


def default_threads() -> int:
    """Threads vLLM's auto binding gives the worker: one per core, one core reserved (>= 1)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n - 1)


# ---------------------------------------------------------------------------------------- driver
def plan(args) -> list[tuple[str, str | None]]:
    """(method, model override) in run order: reference rows first (vLLM pins threads), baselines first."""
    ref = [m for m in args.methods if m.partition(":")[0] in REF_METHODS]
    ref.sort(key=lambda m: m != "ref-vanilla")
    vl = [m for m in args.methods if m.partition(":")[0] in VLLM_METHODS and m != "draft-model"]
    vl.sort(key=lambda m: m != "vanilla")
    out = [(m, None) for m in ref + vl]
    if "draft-model" in args.methods:
        out += [("vanilla", DRAFT_MODEL_TARGET), ("draft-model", DRAFT_MODEL_TARGET)]
    return out


def bench(args) -> tuple[list[dict], list[dict]]:
    import torch
    from tqdm import tqdm

    from falcon_vllm.models import load_chat_prompts

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    data = {d: load_chat_prompts(d, args.num_prompts) for d in args.datasets}
    command = portable_text(" ".join(shlex.quote(x) for x in args.argv0 + args.argv))
    mach = machine(args)
    rows, skipped, tokens_by = [], [], {}
    steps = plan(args)
    bar = tqdm(total=len(steps) * (len(args.datasets) * args.repeats + args.warmup), desc="bench", unit="pass",
               file=sys.stderr, dynamic_ncols=True)
    for method, model_name in steps:
        bar.set_postfix_str(method)
        runner = None
        try:
            model = model_dir(model_name) if model_name else None
            runner = (RefRunner(method, args) if method.startswith("ref-") else VllmRunner(method, args, model))
            runner.start()
        except Skip as e:
            label = method if not model_name else f"{method} ({model_name})"
            print(f"[bench] skipping {label}: {e}", file=sys.stderr, flush=True)
            skipped.append({"method": method, "model": model_name or _short(args.model), "reason": str(e)})
            if runner is not None:
                runner.close()
            bar.update(len(args.datasets) * args.repeats + args.warmup)
            continue
        base = "ref-vanilla" if runner.engine == "reference" else "vanilla"
        warm = [chat_prompt(runner.tok, data[ds][0]["turns"][:1], []) for ds in args.datasets]
        for i in range(args.warmup):  # untimed; counters are snapshotted after it
            runner.generate([warm[i % len(warm)]] * (args.batch_size if runner.engine == "vllm" else 1),
                            max_new_tokens=args.warmup_tokens)
            bar.update(1)
        for ds in args.datasets:
            qs = data[ds]
            tps, secs_all, runs = [], [], []
            before = runner.counters()
            total = 0
            for _ in range(args.repeats):
                toks, secs, n = run_conversations(runner.generate, runner.tok, qs, args.batch_size)
                tps.append(n / secs if secs > 0 else 0.0)
                secs_all.append(secs)
                runs.append(toks)
                total += n
                bar.update(1)
            m = metrics_from_counters(before, runner.counters(), total)
            toks = runs[0]
            key = (base, runner.model, ds)
            if method == base:
                tokens_by[key] = toks
            n_gen = sum(len(t) for q in toks for t in q)
            greedy = args.temperature == 0
            row = Row(method=method, engine=runner.engine, dataset=ds, model=_short(runner.model),
                      drafter=_short(runner.drafter) if runner.drafter and os.sep in str(runner.drafter)
                      else runner.drafter,
                      num_spec_tokens=runner.num_spec_tokens, tree=runner.tree,
                      batch_size=args.batch_size if runner.engine == "vllm" else 1,
                      temperature=args.temperature, num_prompts=len(qs),
                      num_generations=sum(len(q["turns"]) for q in qs), max_new_tokens=args.max_new_tokens,
                      generated_tokens=n_gen,
                      tau=round(m["tau"], 4), tau_excl_bonus=round(m["tau_excl_bonus"], 4),
                      alpha=round(m["alpha"], 4),
                      draft_acceptance_rate=None if m["draft_acceptance_rate"] is None
                      else round(m["draft_acceptance_rate"], 4),
                      per_position_acceptance=[round(x, 4) for x in
                                               m["per_position_acceptance"][:getattr(runner, "depth", None)]],
                      num_drafts=m["num_drafts"], num_draft_tokens=m["num_draft_tokens"],
                      num_accepted_tokens=m["num_accepted_tokens"],
                      tokens_per_s=round(statistics.median(tps), 3),
                      tokens_per_s_std=round(statistics.pstdev(tps), 3) if len(tps) > 1 else 0.0,
                      tokens_per_s_min=round(min(tps), 3), tokens_per_s_max=round(max(tps), 3),
                      repeats=args.repeats, warmup=args.warmup, seconds=[round(s, 3) for s in secs_all],
                      speedup_vs_vanilla=None, baseline=base,
                      greedy_identical=None,
                      deterministic_across_repeats=all(r == toks for r in runs) if greedy else None,
                      command=command, machine=mach)
            brow = next((r for r in rows if r["method"] == base and r["dataset"] == ds
                         and r["model"] == _short(runner.model) and r["engine"] == runner.engine), None)
            if method == base:
                row.speedup_vs_vanilla = 1.0
                row.greedy_identical = True if greedy else None
            elif brow is not None:
                row.speedup_vs_vanilla = round(row.tokens_per_s / brow["tokens_per_s"], 3)
                if greedy:
                    row.greedy_identical = all(r == tokens_by[key] for r in runs)
            rows.append(asdict(row))
            if row.greedy_identical is False:
                rows[-1]["first_mismatch"] = first_mismatch(runs[0], tokens_by[key], qs)
        runner.close()
        del runner
        gc.collect()
    bar.close()
    return rows, skipped


def first_mismatch(toks, ref, qs) -> dict | None:
    """Where a method's greedy tokens first leave the baseline's (for the report)."""
    for qi, (a_q, b_q) in enumerate(zip(toks, ref)):
        for ti, (a, b) in enumerate(zip(a_q, b_q)):
            if a != b:
                pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                return {"question": qs[qi]["id"], "turn": ti, "position": pos, "len": len(a), "baseline_len": len(b)}
    return None


# ---------------------------------------------------------------------------------------- output
def write_results(rows: list[dict], skipped: list[dict], args) -> list[str]:
    out_dir, name = args.out_dir, args.name
    os.makedirs(out_dir, exist_ok=True)
    # paths are shown relative to the project or by their last component: results are committed
    settings = {k: portable(v) for k, v in vars(args).items() if k not in ("argv", "argv0")}
    doc = {"rows": rows, "skipped": skipped, "settings": settings,
           "command": rows[0]["command"] if rows else " ".join(args.argv0 + args.argv),
           "machine": rows[0]["machine"] if rows else None}
    paths = [os.path.join(out_dir, f"{name}.json"), os.path.join(out_dir, f"{name}.md")]
    with open(paths[0], "w") as f:
        json.dump(doc, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(rows, skipped, args))
    paths += plots(rows, out_dir, name)
    return paths


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def markdown(rows, skipped, args) -> str:
    cmd = rows[0]["command"] if rows else " ".join(args.argv0 + args.argv)
    lines = [f"# End-to-end benchmark: {args.name}", "",
             f"Command: `{cmd}`", "",
             f"Machine: {rows[0]['machine'] if rows else machine(args)}", "",
             f"Prompts: the first {args.num_prompts} of each dataset ({', '.join(args.datasets)}); MT-Bench "
             "questions are run as two-turn conversations (turn 2 sees the method's own turn-1 answer), so "
             f"they count 2 generations each. Up to {args.max_new_tokens} new tokens per generation (stops at "
             f"EOS), temperature {args.temperature}, batch size {args.batch_size} (reference rows: 1), "
             f"{args.warmup} warm-up generation(s) of {args.warmup_tokens} tokens per engine, {args.repeats} timed repeat(s) "
             "(tokens/s: median, with min-max).", "",
             "tau includes the bonus token (vLLM's mean acceptance length); tau_excl_bonus is the Falcon "
             "paper's tau. Both and alpha (accepted draft tokens / generated tokens) come from deltas of the "
             "engines' spec-decode counters. Speedup is tokens/s over the same engine's vanilla run on the "
             "same target and prompts in this run (vLLM rows: `vanilla`; reference rows: `ref-vanilla`). "
             "identical: greedy tokens equal the baseline's for every prompt.", "",
             "Settings: in-process vLLM engines (VLLM_ENABLE_V1_MULTIPROCESSING=0), enforce_eager, fp32, "
             "prefix caching " + ("on" if args.prefix_caching else "off") + "; one engine at a time; vLLM "
             "binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND=auto), reference rows run first with "
             f"torch.set_num_threads({args.threads}).", "",
             "| method | engine | dataset | model | drafter | K | tree | gen. tokens | tau | tau excl. bonus | "
             "alpha | tokens/s | tokens/s min-max | speedup | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(x) for x in (
            r["method"], r["engine"], r["dataset"], r["model"], r["drafter"], r["num_spec_tokens"], r["tree"],
            r["generated_tokens"], r["tau"], r["tau_excl_bonus"], r["alpha"], r["tokens_per_s"],
            f"{r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}", r["speedup_vs_vanilla"],
            r["greedy_identical"])) + " |")
    pp = [r for r in rows if r["per_position_acceptance"]]
    if pp:
        lines += ["", "Per-position (chains) / per-depth (trees) acceptance rate "
                      "(accepted at position i / drafts):", ""]
        for r in pp:
            lines.append(f"- {r['method']} / {r['dataset']}: "
                         + ", ".join(f"{x:.3f}" for x in r["per_position_acceptance"]))
    bad = [r for r in rows if r["greedy_identical"] is False]
    if bad:
        lines += ["", "**Greedy outputs differ from the baseline:**", ""]
        for r in bad:
            lines.append(f"- {r['method']} / {r['dataset']}: first mismatch {r.get('first_mismatch')}")
    if skipped:
        lines += ["", "Skipped methods:", ""]
        for s in skipped:
            lines.append(f"- {s['method']} ({s['model']}): {s['reason']}")
    if args.notes:
        with open(args.notes) as f:
            lines += ["", f.read().rstrip()]
    return "\n".join(lines) + "\n"


def plots(rows, out_dir, name) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib missing: no plots", file=sys.stderr)
        return []
    if not rows:
        return []
    labels = list(dict.fromkeys(f"{r['method']}" + ("" if r["model"] == rows[0]["model"] else f" [{r['model']}]")
                                for r in rows))

    def label(r):
        return r["method"] + ("" if r["model"] == rows[0]["model"] else f" [{r['model']}]")

    dsets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    w = 0.8 / max(1, len(labels))
    for i, lab in enumerate(labels):
        xs, sp, lo, hi, tau = [], [], [], [], []
        for j, d in enumerate(dsets):
            r = next((r for r in rows if label(r) == lab and r["dataset"] == d), None)
            if r is None:
                continue
            xs.append(j + i * w)
            s = r["speedup_vs_vanilla"] or 0.0
            sp.append(s)
            scale = s / r["tokens_per_s"] if r["tokens_per_s"] else 0.0
            lo.append(max(0.0, s - r["tokens_per_s_min"] * scale))
            hi.append(max(0.0, r["tokens_per_s_max"] * scale - s))
            tau.append(r["tau"])
        axes[0].bar(xs, sp, w, yerr=[lo, hi], capsize=2, label=lab)
        axes[1].bar(xs, tau, w, label=lab)
    for ax, t in zip(axes, ("speedup vs vanilla (same engine; bars: min-max over repeats)",
                            "tau (tokens per verification step, incl. bonus)")):
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(dsets))], dsets)
        ax.set_title(t, fontsize=9)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{rows[0]['model']}, batch {rows[0]['batch_size']}, T={rows[0]['temperature']}", fontsize=9)
    fig.tight_layout()
    p1 = os.path.join(out_dir, f"{name}_speedup.png")
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(dsets), figsize=(4.2 * len(dsets), 3.6), squeeze=False)
    for ax, d in zip(axes[0], dsets):
        for r in rows:
            if r["dataset"] == d and r["per_position_acceptance"]:
                ax.plot(range(1, len(r["per_position_acceptance"]) + 1), r["per_position_acceptance"], marker="o",
                        label=label(r))
        ax.set_xlabel("draft position (chain) / depth (tree)")
        ax.set_ylabel("accepted fraction of drafts")
        ax.set_ylim(0, 1.02)
        ax.set_title(d, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = os.path.join(out_dir, f"{name}_accept.png")
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


# ------------------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument
    g("--model", default=None, help="target HF dir or offline model name (default: SmolLM2-135M-Instruct)")
    g("--drafter", default=None, help="Falcon drafter dir (default: falcon_vllm/drafters/smollm2-135m-instruct)")
    g("--eagle-drafter", default=None,
      help="EAGLE drafter dir in vLLM's layout (default: falcon_vllm/drafters/smollm2-135m-instruct-eagle*)")
    g("--methods", default="vanilla,falcon-chain,eagle,ngram,draft-model,ref-vanilla,ref-falcon-chain,"
                           "ref-falcon-tree",
      help=f"comma list of {', '.join(VLLM_METHODS + REF_METHODS)} (falcon-tree:<tree> / ref-falcon-tree:<tree> pick a tree)")
    g("--datasets", default="mt-bench,humaneval,gsm8k", help="comma list of mt-bench, humaneval, gsm8k")
    g("--num-prompts", type=int, default=8, help="first N questions of each dataset (MT-Bench: N x 2 turns)")
    g("--max-new-tokens", type=int, default=96)
    g("--batch-size", type=int, default=1, help="prompts submitted together (vLLM continuous batching)")
    g("--temperature", type=float, default=0.0)
    g("--num-spec-tokens", type=int, default=4, help="K for falcon-chain and ref-falcon-chain")
    g("--eagle-spec-tokens", type=int, default=None, help="K for eagle (default: --num-spec-tokens)")
    g("--ngram-spec-tokens", type=int, default=4, help="K for ngram")
    g("--ngram-min", type=int, default=2, help="prompt_lookup_min for ngram")
    g("--ngram-max", type=int, default=4, help="prompt_lookup_max for ngram")
    g("--draft-model-spec-tokens", type=int, default=4, help="K for draft-model")
    g("--tree", default="falcon-llama", help="tree of falcon-tree / ref-falcon-tree without ':<tree>' (preset or file)")
    g("--repeats", type=int, default=1, help="timed passes over all prompts (spread: std/min/max)")
    g("--warmup", type=int, default=1,
      help="untimed generations per engine before timing (first prompt of each dataset in turn)")
    g("--warmup-tokens", type=int, default=16, help="new tokens of each warm-up generation")
    g("--threads", type=int, default=None,
      help="torch threads of the reference rows (default: what vLLM's auto binding gives its worker)")
    g("--max-model-len", type=int, default=2048)
    g("--prefix-caching", action="store_true", help="enable vLLM prefix caching (off: repeats stay comparable)")
    g("--strict", action="store_true", help="fail instead of skipping a method whose vLLM engine fails to start")
    g("--out-dir", default=RESULTS)
    g("--name", default="e2e", help="results go to <out-dir>/<name>.{json,md} and <name>_{speedup,accept}.png")
    g("--notes", default=None, help="markdown file appended to <name>.md (e.g. a comparison with published numbers)")


def finish_args(a, argv) -> argparse.Namespace:
    from falcon_vllm.models import model_path
    a.model = str(model_path(a.model)) if a.model else str(model_path())
    a.drafter = a.drafter or os.path.join(DRAFTERS, "smollm2-135m-instruct")
    if not a.eagle_drafter:
        found = sorted(d for d in glob.glob(os.path.join(DRAFTERS, "smollm2-135m-instruct-eagle*")) if _has_config(d))
        a.eagle_drafter = found[0] if found else os.path.join(DRAFTERS, "smollm2-135m-instruct-eagle")
    a.eagle_spec_tokens = a.eagle_spec_tokens or a.num_spec_tokens
    a.threads = a.threads or default_threads()
    if isinstance(a.methods, str):
        a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if isinstance(a.datasets, str):
        a.datasets = [d.strip() for d in a.datasets.split(",") if d.strip()]
    a.argv = list(sys.argv[1:] if argv is None else argv)
    a.argv0 = [os.path.relpath(os.path.abspath(__file__))] if argv is None else ["benchmarks/studies/bench_e2e.py"]
    return a


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_e2e.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    a = p.parse_args(argv)
    bad = [m for m in a.methods.split(",") if m.strip() and m.strip().partition(":")[0] not in VLLM_METHODS + REF_METHODS]
    if bad:
        p.error(f"unknown methods {bad}; choose from {', '.join(VLLM_METHODS + REF_METHODS)}")
    if a.repeats < 1 or a.warmup < 0 or a.batch_size < 1 or a.num_prompts < 1:
        p.error("--repeats, --batch-size and --num-prompts must be >= 1, --warmup >= 0")
    return finish_args(a, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows, skipped = bench(args)
    paths = write_results(rows, skipped, args)
    for r in rows:
        print(f"{r['method']:24s} {r['dataset']:10s} tau={r['tau']:.2f} alpha={r['alpha']:.2f} "
              f"tok/s={r['tokens_per_s']:.1f} speedup={r['speedup_vs_vanilla']} identical={r['greedy_identical']}")
    for s in skipped:
        print(f"skipped {s['method']} ({s['model']}): {s['reason']}")
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
