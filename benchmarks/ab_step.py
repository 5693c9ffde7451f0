"""A/B end-to-end ratio of vLLM configurations, all engines in one process, generations alternating.

Separate processes per configuration (``profile_step.py``, ``studies/bench_e2e.py``) see per-process effects on
a shared CPU (where the weights land in memory, load drift between processes) of 10-20%, larger than
the differences some questions ask about (e.g. "does a step whose schedule drafts nothing cost what a
vanilla step costs, within 2%?").  Here every configuration's engine lives in this one process; the
timed generations alternate between them (the order rotating every pair), each generation of a
configuration is divided by the baseline's (the first configuration) generation next to it, and the
median of those ratios is reported with its spread.  The outputs are checked against the baseline's
(greedy: token-identical).  With ``--temperature`` above 0 every configuration samples (its outputs differ
from the baseline's draw by draw; that they follow the same distribution is what the losslessness tests
show), every generation runs its full --max-new-tokens (EOS ignored), so each pair times equal work.

  python benchmarks/ab_step.py --configs vanilla,tree:benchmarks/results/tree_smollm2_v2_tuned.json \\
      --batch-sizes 1,4 --max-new-tokens 32 --pairs 10 --name ab_drafting_off

Configurations as in profile_step.py: vanilla, chain[:K], lookup[:K[:F[:L[:N]]]] (prompt lookup of up to K
tokens first, adaptive from L tokens when given, n-grams of N (default 2) to 4 tokens; Falcon's chain of F
otherwise), tree[:<tree>] (Falcon, --drafter), plus eagle[:K] (vLLM's EAGLE, --eagle-drafter), ngram[:K],
and falcon (the drafter's serving.json decides); a suffix
``@<dir>`` gives that configuration another drafter (e.g. ``chain:2@runs/falcon-2layers``) and suffixes
``%key=value`` more speculative-config options (e.g. ``falcon%draft_gemm_dtype=model``), and a last suffix
``^attr=value`` sets an attribute of the Falcon proposer (e.g. ``falcon^prune_chunk=false``): configurations that
differ only in it share one engine, switched before each of their generations, so their ratio (one of them the
baseline) sees only what the switch changes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# several engines live in this process: 1 GiB of KV cache each (harness.engines sets the rest of the environment)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from harness.engines import build_engines, command_line, compile_words  # noqa: E402  (sets the environment)
from harness.machine import cpu_name  # noqa: E402
from harness.paths import RESULTS, drafters_for, portable_text  # noqa: E402
from harness.report import write_report  # noqa: E402


def run(args, keep: dict | None = None) -> list[dict]:
    """Build the engines, time the alternating generations, return one row per configuration and batch size.
    ``keep`` (a dict), when given, receives the engines (``engines``: label -> LLM, still running) and every timed
    generation's outputs (``outputs``: label -> per pair, the list of vLLM's ``RequestOutput``)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from falcon_vllm.models import chat_ids, load_chat_prompts, model_path

    model = args.model or str(model_path())
    tok = AutoTokenizer.from_pretrained(model)

    def chat(messages):
        return {"prompt_token_ids": chat_ids(tok, messages, add_generation_prompt=True)}

    questions = load_chat_prompts(args.dataset, max(args.prompts or 0, *args.batch_sizes))
    last = args.turn or min(len(q["turns"]) for q in questions)  # --turn 0: every turn of the conversation
    if any(len(q["turns"]) < last for q in questions):
        raise SystemExit(f"falcon-vllm: --turn {args.turn}: {args.dataset} questions have fewer turns")
    history = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
    labels, engines, switch, step_count = build_engines(args, model, max(args.batch_sizes))
    if keep is not None:
        keep["engines"] = engines
    base = labels[0]
    turns = [[chat(h) for h in history]]  # turns[t]: each conversation's prompt at turn t + 1
    for t in range(1, last):  # later turns: the conversation so far, with the baseline's greedy answers
        switch(base)
        answers = engines[base].generate(turns[-1], SamplingParams(max_tokens=args.max_new_tokens, temperature=0),
                                         use_tqdm=False)
        for h, a, q in zip(history, answers, questions):
            h += [{"role": "assistant", "content": a.outputs[0].text}, {"role": "user", "content": q["turns"][t]}]
        turns.append([chat(h) for h in history])
    timed = turns if args.turn == 0 else turns[-1:]  # the turns a generation pair runs, one after another
    sp = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        ignore_eos=not args.stop_at_eos)
    rows = []
    for B in args.batch_sizes:
        N = max(args.prompts or B, B)
        batches = [[[p[(i * B + j) % N] for j in range(B)] for p in timed] for i in range(args.pairs)]  # pair i's
        for c, llm in engines.items():  # warm-up
            switch(c)
            llm.generate(batches[0][0], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
        secs = {c: [] for c in labels}
        outs = {c: [] for c in labels}
        steps = {c: 0 for c in labels}
        drafting = {c: 0.0 for c in labels}
        for i, batch in enumerate(batches):
            n = len(labels)
            order = [labels[(i + j) % n] for j in range(n)]  # rotate: no configuration always first
            for c in order:
                switch(c)
                before, draft_before, _ = step_count[c]
                t0 = time.perf_counter()
                o = [x for turn in batch for x in engines[c].generate(turn, sp, use_tqdm=False)]
                secs[c].append(time.perf_counter() - t0)
                if keep is not None:
                    keep.setdefault("outputs", {}).setdefault(c, []).append(o)
                steps[c] += step_count[c][0] - before
                drafting[c] += step_count[c][1] - draft_before
                outs[c].append([list(x.outputs[0].token_ids) for x in o])
        for c in labels:
            ratios = [b / s for s, b in zip(secs[c], secs[base])]  # speedup of c over the baseline, per pair
            tokens = sum(len(t) for batch_out in outs[c] for t in batch_out)
            rows.append({
                "config": portable_text(c), "batch_size": B, "pairs": args.pairs,
                "median_s": statistics.median(secs[c]),
                "tokens_per_s": tokens / sum(secs[c]),
                "tokens_per_generation": tokens / (args.pairs * B),
                "speedup_vs_base": statistics.median(ratios),
                "speedup_total": sum(secs[base]) / sum(secs[c]),  # the whole workload's time ratio
                "speedup_min": min(ratios), "speedup_max": max(ratios),
                "steps_per_generation": steps[c] / args.pairs,
                "ms_per_step": 1e3 * sum(secs[c]) / steps[c],
                "drafting_ms_per_step": 1e3 * drafting[c] / steps[c],
                "identical_to_base": outs[c] == outs[base] if args.temperature == 0 else None,  # sampled: differ
            })
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}),
                  file=sys.stderr, flush=True)
    return rows


def write(args, rows) -> None:
    cmd = command_line("ab_step.py")
    meta = {"command": cmd, "machine": cpu_name(), "baseline": portable_text(args.configs[0]),
            "dataset": args.dataset, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "compile": args.compile, "build_order": args.build_order}
    decoding = "greedy" if args.temperature == 0 else f"sampled at temperature {args.temperature:g}" + (
        f", top-p {args.top_p:g}" if args.top_p < 1 else "")
    lines = [f"# A/B in one process: {args.name}", "", f"Command: `{cmd}`", "",
             f"Machine: {meta['machine']}.  All engines in one process; {args.pairs} alternating generations of "
             f"{args.max_new_tokens} tokens{' per turn' if args.turn == 0 else ''} per configuration and batch size "
             f"({args.dataset} prompts"
             f"{f', turn {args.turn} after the baseline answered the earlier turns' if args.turn > 1 else ''}"
             f"{', every turn (a generation: the conversation, later turns after the baseline answers)' if args.turn == 0 else ''}"
             f"{f', rotating over the first {args.prompts}' if args.prompts else ''}, {decoding}, "
             f"{'stopping at EOS' if args.stop_at_eos else 'EOS ignored'}; "
             f"{compile_words(args.compile)}; engines built "
             f"{'in the configurations' if args.build_order == 'given' else 'in the reverse of the configurations'}"
             f"' order).  speedup = baseline seconds / configuration seconds of the generation pair, median "
             f"(min-max) over the pairs; total: the same ratio over all pairs' seconds (the workload's time); "
             f"baseline `{portable_text(args.configs[0])}`.  steps/generation: the runner's model "
             f"steps per generation, prefill included, until the batch's slowest request is done; ms/step: the "
             f"generations' seconds per step; drafting: the runner's propose_draft_token_ids (vLLM's drafter input "
             f"preparation and the drafter) per step.", "",
             "| config | B | tok/s | speedup vs baseline | min-max | total | tokens/generation | steps/generation | "
             "ms/step | drafting ms/step | identical to baseline |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_base']:.3f}x | "
                     f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f} | {r['speedup_total']:.3f}x | "
                     f"{r['tokens_per_generation']:.1f} | "
                     f"{r['steps_per_generation']:.1f} | {r['ms_per_step']:.1f} | {r['drafting_ms_per_step']:.2f} | "
                     f"{'- (sampled)' if r['identical_to_base'] is None else r['identical_to_base']} |")
    write_report(args.out_dir, args.name, {**meta, "rows": rows}, lines)


def main(argv=None, prog: str | None = None, description: str | None = None, defaults: dict | None = None) -> None:
    """Parse ``argv`` (``prog``, ``description`` and ``defaults`` let ``falcon-vllm bench`` present it), run, write."""
    args = parse(argv, prog, description, defaults)
    write(args, run(args))


def parse(argv=None, prog: str | None = None, description: str | None = None, defaults: dict | None = None):
    """The command line's options, checked (``falcon-vllm bench`` and ``falcon-vllm demo`` parse theirs here too)."""
    p = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="vanilla,chain:2",
                   help="comma-separated; the first is the baseline (default: %(default)s)")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="generations stop at EOS (default: EOS ignored, every generation --max-new-tokens long)")
    p.add_argument("--pairs", type=int, default=10, help="timed generations per configuration and batch size")
    p.add_argument("--prompts", type=int, default=0,
                   help="rotate over the first N prompts (pair i takes the next B of them; default: the first B)")
    p.add_argument("--dataset", default="mt-bench", help="prompt set of falcon_vllm.models.load_chat_prompts")
    p.add_argument("--turn", type=int, default=1,
                   help="time this turn of each conversation (MT-Bench has 2), 0: every turn, one after another; "
                        "later turns follow the baseline's greedy answers (up to --max-new-tokens) to earlier ones")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (outputs checked token for token); above 0: sampled, EOS ignored")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature above 0")
    p.add_argument("--num-spec-tokens", type=int, default=2, help="K of `chain` / `ngram` without one")
    p.add_argument("--drafter", default=None,
                   help="Falcon drafter (default: the one shipped for --model, as \"model\": \"falcon\" finds it)")
    p.add_argument("--eagle-drafter", default=None,
                   help="EAGLE drafter (vLLM's layout) of `eagle[:K]`")
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct, converted)")
    p.add_argument("--compile", nargs="?", const="all", default="", metavar="LABELS",
                   help="vLLM's default torch.compile mode (as `vllm serve` runs) instead of eager, for every engine "
                        "or for the comma-separated configuration labels given (a configuration given twice is "
                        "labelled <config>#<index>: `--configs vanilla,vanilla --compile 'vanilla#1'` times eager "
                        "against compiled); a compiled engine takes a minute or two more to build")
    p.add_argument("--build-order", choices=("given", "reversed"), default="given",
                   help="build the engines in --configs' order or the reverse (the baseline stays the first "
                        "configuration): an engine built later can run a few percent slower in one process, so a "
                        "small difference is worth measuring both ways (default: %(default)s)")
    p.add_argument("--name", default="ab_step", help="writes <out-dir>/<name>.{json,md} (default: %(default)s)")
    p.add_argument("--out-dir", default=RESULTS, help="default: benchmarks/results")
    p.set_defaults(**(defaults or {}))
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.drafter, args.eagle_drafter = drafters_for(args.model, args.drafter, args.eagle_drafter)
    if args.turn < 0:
        raise SystemExit("falcon-vllm: --turn takes a turn number (1, 2, ...) or 0 for every turn")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SystemExit("falcon-vllm: --temperature must be >= 0 and --top-p in (0, 1]")
    if args.temperature > 0 and args.stop_at_eos:
        raise SystemExit("falcon-vllm: --stop-at-eos with --temperature: sampled generations would end at different "
                         "lengths and a pair would not time equal work; leave EOS ignored")
    if len(args.configs) < 2:
        raise SystemExit("falcon-vllm: --configs needs a baseline and at least one configuration to compare")
    return args


if __name__ == "__main__":
    main()
