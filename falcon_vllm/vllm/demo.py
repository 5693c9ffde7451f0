"""``falcon-vllm demo`` (``make demo``): a target with and without falcon, in vLLM on CPU.

Answers a few MT-Bench questions with vanilla decoding and with Falcon speculative decoding and prints the answers.
The two engines are measured the way ``falcon-vllm bench`` measures them (the repository's same-run A/B,
``benchmarks/ab_step.py``): both engines in this process, timed generations alternating between them, each
question answered ``--pairs`` / ``--questions`` times by each.  It prints tokens per second, tokens per step (every
model step, the prefill included), the time of a step against a vanilla step, and the speedup, which over the whole
run is exactly tokens per step over step cost; and whether the greedy outputs are identical.  The target is
SmolLM2-135M-Instruct unless ``--target`` names another offline model (``make models-qwen``:
qwen2.5-coder-1.5b-instruct) or a directory; the drafter is the shipped one whose recorded target it is, as
``"model": "falcon"`` resolves it, unless ``--drafter`` gives one.
"""

from __future__ import annotations

import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def add_arguments(p):
    p.add_argument("--target", default=None,
                   help="an offline model's name (default: smollm2-135m-instruct) or a target directory")
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--pairs", type=int, default=None,
                   help="timed generations per engine, alternating (default: each question twice)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="chain length (default: the drafter's recommended configuration, its serving.json)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one for the target)")
    p.add_argument("--tree", default=None,
                   help="run falcon in tree mode with this tree (e.g. falcon-llama, tree-2x2x1); default: a chain "
                        "of --num-speculative-tokens")
    p.add_argument("--build-order", choices=("given", "reversed"), default="given",
                   help="build vanilla's engine first (given) or falcon's (reversed); in one process the engine "
                        "built later can run a few percent slower")


def _drafter(target: str, drafter: str | None) -> str:
    """The drafter to run: the given one, the shipped one for the target, else a random one (said so)."""
    from transformers import AutoConfig

    if drafter is None:  # the shipped drafter for this target, before any engine starts (else: what was tried)
        from falcon_vllm.vllm.options import resolve_drafter

        drafter = resolve_drafter("falcon", AutoConfig.from_pretrained(target))
    if not os.path.exists(os.path.join(drafter, "model.safetensors")):
        import tempfile

        import torch

        from falcon_vllm.config import FalconConfig
        from falcon_vllm.drafter import FalconDrafter
        print(f"NOTE: no trained drafter at {drafter}; using a RANDOM drafter (outputs stay identical, "
              "tokens per step will be ~1). Train one with `falcon-vllm train`.")
        torch.manual_seed(0)
        drafter = tempfile.mkdtemp(prefix="falcon-random-")
        FalconDrafter(FalconConfig.from_target(AutoConfig.from_pretrained(target))).save_pretrained(drafter)
    return drafter


def _how(llm) -> str:
    """What the Falcon engine drafts, in words."""
    from falcon_vllm.vllm.live import falcon_section

    sc = llm.llm_engine.vllm_config.speculative_config
    serving = falcon_section(sc.draft_model_config)
    if serving.mode == "tree":
        return f"tree {serving.tree_name} ({sc.num_speculative_tokens} nodes)"
    if (lk := serving.lookup) is not None:
        K, L = sc.num_speculative_tokens, lk.lookup_tokens
        size = f"{L} to {K} tokens, adaptive" if L < K else f"up to {K} tokens"
        return (f"prompt lookup ({lk.prompt_lookup_min}-{lk.prompt_lookup_max}-grams, {size}) first, "
                + ("then the target's stored answers (datastore), " if lk.datastore else "")
                + f"the drafter's chain of {lk.drafter_tokens} otherwise")
    return f"chain K={sc.num_speculative_tokens}"


def main(args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not os.path.exists(os.path.join(BENCH, "ab_step.py")):
        print("falcon-vllm: demo needs the repository checkout (benchmarks/ab_step.py); clone the repository and "
              "install it with `pip install -e .`", file=sys.stderr)
        return 2
    sys.path.insert(0, BENCH)  # the benchmark harness lives in the checkout, not in the package
    import ab_step  # sets the measured environment: engines in this process, 1 GiB of KV cache each

    from falcon_vllm.models import load_chat_prompts, model_path
    from falcon_vllm.vllm.engine import shutdown_llm

    target = str(model_path(args.target) if args.target else model_path())
    drafter = _drafter(target, args.drafter)
    falcon = (f"tree:{args.tree}" if args.tree else
              f"chain:{args.num_speculative_tokens}" if args.num_speculative_tokens else "falcon")
    pairs = args.pairs or 2 * args.questions
    ab = ab_step.parse(["--configs", f"vanilla,{falcon}", "--batch-sizes", "1", "--max-new-tokens",
                        str(args.max_tokens), "--pairs", str(pairs), "--prompts", str(args.questions), "--stop-at-eos",
                        "--model", target, "--drafter", drafter, "--build-order", args.build_order])
    keep = {}
    rows = ab_step.run(ab, keep)
    how = _how(keep["engines"][falcon])
    for llm in dict.fromkeys(keep["engines"].values()):
        shutdown_llm(llm)
    keep.pop("engines")
    qs = load_chat_prompts("mt-bench", args.questions)
    for q, o in zip(qs, keep["outputs"][falcon]):  # pair i answers question i (mod --questions)
        print(f"\n### Q{q['id']}: {q['turns'][0][:100]}\n{o[0].outputs[0].text.strip()[:600]}")
    v, f = (next(r for r in rows if r["config"] == c) for c in ("vanilla", falcon))
    tau_v, tau_f = (r["tokens_per_generation"] / r["steps_per_generation"] for r in (v, f))
    cost = f["ms_per_step"] / v["ms_per_step"]
    built = "vanilla's engine first" if args.build_order == "given" else "falcon's engine first"
    print("\n" + "=" * 72)
    print(f"{pairs} timed generations per engine, alternating, both engines in this process ({built}); "
          f"batch 1, greedy, up to {args.max_tokens} tokens")
    print(f"falcon drafts: {how}; drafter {os.path.basename(drafter.rstrip('/'))}")
    print(f"vanilla : {v['tokens_per_s']:.1f} tokens/s, {tau_v:.2f} tokens per step, {v['ms_per_step']:.1f} ms a step")
    print(f"falcon  : {f['tokens_per_s']:.1f} tokens/s, {tau_f:.2f} tokens per step, {f['ms_per_step']:.1f} ms a step "
          f"({cost:.2f} of a vanilla step, drafting {f['drafting_ms_per_step']:.1f} ms of it)")
    print(f"speedup : {f['speedup_total']:.2f}x over the whole run = {tau_f / tau_v:.2f}x the tokens per step / "
          f"{cost:.2f} step cost (median pair {f['speedup_vs_base']:.2f}x, "
          f"{f['speedup_min']:.2f}-{f['speedup_max']:.2f})")
    if cost < 1:
        print("A falcon step verified several tokens and ran the drafter, yet took less time than a vanilla step: on "
              "this CPU the target computes a few rows in less time than one (docs/findings.md, 'Step cost on a CPU').")
    print(f"greedy outputs identical: {f['identical_to_base']}")
    return 0 if f["identical_to_base"] else 1
