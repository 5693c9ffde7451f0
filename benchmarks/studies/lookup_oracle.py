#!/usr/bin/env python
"""Study: How good is the shipped per-step choice between prompt lookup and the drafter's chain?

Answer: Within 5% / 3.5% / 9% (MT-Bench / HumanEval / GSM8K) of a per-step oracle that knows which draft the
target accepts more of.
Result: benchmarks/results/lookup_oracle.md

Prompt lookup against the drafter's chain, step by step: how good is the shipped choice between them?

The shipped Falcon default drafts each step either by prompt lookup (a repeated n-gram's continuation)
or, where no n-gram repeats, by the drafter's chain.  This script runs that default in vLLM (in-process,
batch 1, greedy, stopping at EOS) with the drafter's chain computed at every step, lookup steps included,
and records each step's history length, lookup draft and chain.  The target's greedy answer then tells
how many tokens any draft of that step would have had accepted, so other policies can be scored on the
same steps without running them:

  shipped          lookup draft where one exists, the chain elsewhere
  agree-gated      the lookup draft only where its first token is the chain's, the chain elsewhere
  oracle           per step, whichever of the two the target accepts more of (an upper bound)
  lookup min n     vLLM's matcher with another shortest n-gram (1 or 3 instead of 2), chain elsewhere
  chain+lookup     on chain steps, the chain extended by the lookup continuation of history + chain
  datastore        (with --datastore) on chain steps, the datastore's draft of the lookup's length where it
                   has one (falcon_vllm.datastore: the target's stored answers), the chain elsewhere
  datastore or chain (with --datastore) on chain steps, whichever of the two the target accepts more of

Scores are accepted draft tokens per step over the recorded steps (the shipped default's trajectory:
a policy that changed one step's acceptance would change the following steps, which are not re-run).

The records also hold the drafter's probability of each chain token; ``--gated`` scores chains cut by that
confidence (``draft_confidence``: cut before the first token where the product of the probabilities falls below
tau) with a modelled step cost, and prints the calibration (the target's acceptance per probability bin).
``--chain-tokens 4`` records chains of 4 (two drafter passes) so that longer gated chains can be scored.

  python benchmarks/studies/lookup_oracle.py --datasets mt-bench,humaneval,gsm8k --prompts 12 \\
      --max-new-tokens 96 --name lookup_oracle
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness

import harness.engines  # noqa: E402,F401  (its environment: in-process engine, offline)
from harness.machine import cpu_name  # noqa: E402
from harness.paths import DEFAULT_DRAFTER, RESULTS  # noqa: E402
from harness.report import write_report  # noqa: E402
from serving_sim import accepted  # noqa: E402


def record(args) -> dict:
    """Run the default over each dataset -> {dataset: {"steps": [(history length, lookup, chain)], "seqs": [...]}}."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from falcon_vllm.models import chat_ids, load_chat_prompts, model_path
    from falcon_vllm.core.lookup import LookupState
    from falcon_vllm.core.plan import StepPlan
    from falcon_vllm.vllm import hooks
    from falcon_vllm.vllm.proposer import FalconProposer

    steps: list = []
    conf: list = []  # this step's chain: the drafter's probability of each drafted token (its argmax)
    plan, merge, draft = hooks.plan_v1_step, LookupState.merge, FalconProposer._draft

    def draft_and_note(self, rows, sampling_metadata=None, probs=None, gate=None):
        B, k, H = rows.shape
        p = self.model.compute_logits(rows.reshape(B * k, H)).float().softmax(-1).amax(-1)
        conf.extend(p.view(B, k)[0].tolist())
        return draft(self, rows, sampling_metadata, probs, gate)

    def plan_and_note(lookup, runner, sampled, k):
        out = plan(lookup, runner, sampled, k)
        b = runner.input_batch
        new = (sampled.cpu().numpy()[0] >= 0).sum() if hasattr(sampled, "cpu") else 0
        lookup._noted = int(b.num_tokens_no_spec[0] + new)
        return out

    def merge_and_note(self, step_plan, falcon, probs=None):
        chain = falcon.tolist()[0]
        steps.append((self._noted, list(step_plan.lookup[0]), chain, [round(c, 4) for c in conf[:len(chain)]]))
        conf.clear()
        return merge(self, step_plan, falcon, probs)

    hooks.plan_v1_step, LookupState.merge, FalconProposer._draft = plan_and_note, merge_and_note, draft_and_note
    StepPlan.all_matched = property(lambda self: False)  # the chain at every step
    model = str(model_path())
    tok = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, max_num_seqs=1, seed=0,
              enable_prefix_caching=False, speculative_config=dict(method="falcon", model=args.drafter, num_speculative_tokens=8,
                                                                 prompt_lookup_min=2, prompt_lookup_max=4, lookup_tokens=4,
                                                                 falcon_tokens=args.chain_tokens))
    sp = SamplingParams(max_tokens=args.max_new_tokens, temperature=0)
    out = {}
    for ds in args.datasets:
        runs = []
        for q in load_chat_prompts(ds, args.prompts):
            ids = chat_ids(tok, [{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True)
            steps.clear()
            o = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
            runs.append({"seq": ids + list(o.outputs[0].token_ids), "steps": list(steps)})
        out[ds] = runs
        print(f"{ds}: {sum(len(r['steps']) for r in runs)} steps recorded", file=sys.stderr, flush=True)
    return out


def score(runs, store=None) -> dict:
    from falcon_vllm.core.lookup import lookup_drafts

    def look(hist, min_n, k):
        return lookup_drafts(np.array([hist], dtype=np.int32), np.array([len(hist)]), None, np.array([True]),
                             min_n, 4, k, 1 << 20)[0]

    tot = {p: 0 for p in ("shipped", "agree-gated", "oracle", "lookup min n 1", "lookup min n 3", "chain+lookup")
           + (("datastore", "datastore or chain") if store is not None else ())}
    n = lookup_steps = chain_acc_on_lookup = chain_acc_elsewhere = 0
    for run in runs:
        seq = run["seq"]
        for h, lk, chain in (step[:3] for step in run["steps"]):
            truth = seq[h:h + 16]
            a_l, a_c = accepted(lk, truth), accepted(chain, truth)
            n += 1
            lookup_steps += bool(lk)
            chain_acc_on_lookup += a_c if lk else 0
            chain_acc_elsewhere += 0 if lk else a_c
            tot["shipped"] += a_l if lk else a_c
            tot["agree-gated"] += a_l if lk and lk[0] == chain[0] else a_c
            tot["oracle"] += max(a_l, a_c) if lk else a_c
            for m in (1, 3):
                alt = look(seq[:h], m, len(lk) or 4)
                tot[f"lookup min n {m}"] += accepted(alt, truth) if alt else a_c
            if store is not None:
                ds = [] if lk else store.draft(seq[:h], 4)
                a_d = accepted(ds, truth) if ds else 0
                tot["datastore"] += a_l if lk else a_d if ds else a_c
                tot["datastore or chain"] += a_l if lk else max(a_d, a_c)
            if lk:
                tot["chain+lookup"] += a_l
            else:
                ext = look(seq[:h] + chain, 2, 4) if a_c == len(chain) else []
                tot["chain+lookup"] += a_c + accepted(ext, truth[len(chain):])
    return {"steps": n, "lookup_steps": lookup_steps,
            "chain_accepted_on_lookup_steps": chain_acc_on_lookup / max(lookup_steps, 1),
            "chain_accepted_on_chain_steps": chain_acc_elsewhere / max(n - lookup_steps, 1),
            "accepted_per_step": {p: v / n for p, v in tot.items()}}


def gated(runs, taus=(0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4), lengths=(2, 4), k: int = 2, row_cost: float = 0.085,
          pass_cost: float = 0.07) -> dict:
    """Confidence-gated chains on the recorded steps (records with the chain's probabilities): on each chain step
    the chain is cut before its first token where the product of the drafter's probabilities falls below tau, at
    most ``n`` tokens; a pass after the first runs only where the tokens before it all passed the gate.  Lookup
    steps are unchanged.  Per policy: accepted draft tokens, verified rows and extra drafter passes per step, and a
    modelled step cost in vanilla steps (``1 + row_cost * (rows - 1) + pass_cost * extra passes``; the first
    drafter pass runs every step on CPU and is left out) and tokens per modelled cost relative to the shipped
    chain of 2.  Also the calibration: per chain position and probability bin, how often the target accepts the
    token given that the tokens before it were accepted."""
    bins = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.01)
    calib = {}
    pol = {}
    n_steps = 0
    for run in runs:
        seq = run["seq"]
        for step in run["steps"]:
            if len(step) < 4:
                raise ValueError("these records have no chain probabilities: record them again")
            h, lk, chain, conf = step
            truth = seq[h:h + 16]
            n_steps += 1
            if not lk:
                a = accepted(chain, truth)
                for j, c in enumerate(conf):
                    if j > a:
                        break
                    b = next(i for i in range(len(bins) - 1) if c < bins[i + 1])
                    cell = calib.setdefault((j, b), [0, 0])
                    cell[0] += 1
                    cell[1] += j < a
            for n in lengths:
                for tau in taus:
                    keep = 0
                    cum = 1.0
                    for c in conf[:n]:
                        cum *= c
                        if cum < tau:
                            break
                        keep += 1
                    d = lk if lk else chain[:keep]
                    extra = 0 if lk else min(keep // k, math.ceil(n / k) - 1)  # a pass runs after a full block
                    t = pol.setdefault((n, tau), [0, 0, 0])
                    t[0] += accepted(d, truth)
                    t[1] += 1 + len(d)
                    t[2] += extra
    out = {"calibration": [{"position": j, "bin": [bins[b], min(bins[b + 1], 1.0)], "count": c, "accepted": a / c}
                           for (j, b), (c, a) in sorted(calib.items())],
           "policies": [], "row_cost": row_cost, "pass_cost": pass_cost, "steps": n_steps}
    base = None
    for (n, tau), (acc, rows, extra) in sorted(pol.items()):
        cost = 1 + row_cost * (rows / n_steps - 1) + pass_cost * extra / n_steps
        rate = (1 + acc / n_steps) / cost
        if n == 2 and tau == 0.0:
            base = rate
        out["policies"].append({"max_tokens": n, "tau": tau, "accepted_per_step": acc / n_steps,
                                "rows_per_step": rows / n_steps, "extra_passes_per_step": extra / n_steps,
                                "modelled_cost": cost, "tokens_per_cost": rate})
    for q in out["policies"]:
        q["vs_shipped"] = q["tokens_per_cost"] / base
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", default="mt-bench,humaneval,gsm8k")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER)
    p.add_argument("--datastore", help="also score drafts from this datastore (`falcon-vllm datastore`)")
    p.add_argument("--save-records", help="write the recorded steps to this JSON file")
    p.add_argument("--records", help="score the steps of a --save-records file instead of recording them")
    p.add_argument("--chain-tokens", type=int, default=2,
                   help="the drafter's chain length while recording (falcon_tokens; 4 runs two drafter passes)")
    p.add_argument("--gated", action="store_true",
                   help="also score confidence-gated chains (needs records with the chain's probabilities)")
    p.add_argument("--name", default="lookup_oracle")
    args = p.parse_args(argv)
    args.datasets = [d for d in args.datasets.split(",") if d]
    if args.records:
        with open(args.records) as f:
            runs = json.load(f)
    else:
        runs = record(args)
    if args.save_records:
        with open(args.save_records, "w") as f:
            json.dump(runs, f)
    store = None
    if args.datastore:
        from falcon_vllm.datastore import Datastore

        store = Datastore.load(args.datastore)
    res = {ds: score(r, store) for ds, r in runs.items()}
    cmd = "python benchmarks/studies/lookup_oracle.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    gates = {ds: gated(r) for ds, r in runs.items()} if args.gated else None
    policies = list(next(iter(res.values()))["accepted_per_step"])
    chain = max(len(step[2]) for r in runs.values() for run in r for step in run["steps"])
    lines = [f"# Prompt lookup against the drafter's chain, per step: {args.name}", "", f"Command: `{cmd}`", "",
             f"Machine: {cpu_name()}.  The shipped default at batch 1 (greedy, {args.max_new_tokens} tokens, stopping at "
             f"EOS, the first {args.prompts} prompts), the drafter's chain"
             + ("" if chain == 2 else f" (of {chain} tokens while recording)") + " computed at every step; accepted draft "
             "tokens per step of each policy on the recorded steps (see the script's docstring).", "",
             "| dataset | steps | lookup steps | chain accepted: chain steps | lookup steps | "
             + " | ".join(policies) + " |", "|---|---|---|---|---|" + "---|" * len(policies)]
    for ds, r in res.items():
        lines.append(f"| {ds} | {r['steps']} | {r['lookup_steps']} | {r['chain_accepted_on_chain_steps']:.2f} | "
                     f"{r['chain_accepted_on_lookup_steps']:.2f} | "
                     + " | ".join(f"{r['accepted_per_step'][q]:.3f}" for q in policies) + " |")
    if gates:
        g0 = next(iter(gates.values()))
        lines += ["", "## Confidence-gated chains", "",
                  f"On each chain step the chain is cut before its first token where the product of the drafter's "
                  f"probabilities falls below tau (at most `max` tokens; a second drafter pass only where the first "
                  f"block passed whole); lookup steps unchanged.  Modelled step cost in vanilla steps: 1 + "
                  f"{g0['row_cost']} x (verified rows - 1) + {g0['pass_cost']} x extra drafter passes; "
                  "`vs shipped`: tokens per modelled cost against the chain of 2 ungated (max 2, tau 0).", "",
                  "| dataset | max | tau | accepted/step | rows/step | extra passes/step | modelled cost | vs shipped |",
                  "|---|---|---|---|---|---|---|---|"]
        for ds, g in gates.items():
            for q in g["policies"]:
                lines.append(f"| {ds} | {q['max_tokens']} | {q['tau']} | {q['accepted_per_step']:.3f} | "
                             f"{q['rows_per_step']:.2f} | {q['extra_passes_per_step']:.2f} | {q['modelled_cost']:.3f} | "
                             f"{q['vs_shipped']:.3f} |")
        lines += ["", "Calibration (chain steps): the target's acceptance of chain token j given tokens before it "
                  "accepted, by the drafter's probability of it.", "",
                  "| dataset | position | drafter probability | count | accepted |", "|---|---|---|---|---|"]
        for ds, g in gates.items():
            for c in g["calibration"]:
                lines.append(f"| {ds} | {c['position']} | {c['bin'][0]:.1f}-{c['bin'][1]:.1f} | {c['count']} | "
                             f"{c['accepted']:.3f} |")
    write_report(RESULTS, args.name,
                 {"command": cmd, "machine": cpu_name(), "results": res} | ({"gated": gates} if gates else {}), lines)


if __name__ == "__main__":
    main()
