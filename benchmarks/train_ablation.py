#!/usr/bin/env python
"""Training ablation on one gen-data directory: SAR k=2 without glancing, CSGD and its disputed
details (one flag changed at a time from the defaults), and the EAGLE-1 baseline (k=1), all with the
same data, architecture (1 layer, fc fusion), optimizer and number of steps.

    python benchmarks/train_ablation.py --data <gen-data dir> --work <dir> --epochs 10 --parallel 2

Each variant runs ``falcon-vllm train`` in its own process (``--threads 1``; ``--parallel`` of them
at once) and is resumable (finished variants are skipped).  Reported per variant: held-out
per-block-position top-1 accuracy against the target's argmax, held-out simulated tau of the
variant's tree (falcon-llama for k=2, eagle-small for k=1) and of a common chain-4, wall time.
Writes ``benchmarks/results/<name>.{json,md}``.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from harness.paths import RESULTS

# name -> (flags changed from the defaults, what it tests)
VARIANTS = {
    "csgd": ([], "CSGD, code defaults: uniform glance over every k-th loss position, glanced kept in the loss, "
                 "code lambda 0.45->0.10, length-scaled noise"),
    "sar-noglance": (["--glance", "none"], "SAR k=2, no glancing"),
    "eagle": (["--mode", "eagle"], "EAGLE-1 baseline (k=1, no glancing)"),
    "csgd-error": (["--glance", "error"], "glance among mispredicted positions (paper reading)"),
    "csgd-mask": (["--glance-loss", "mask"], "glanced positions removed from the loss (GLAT)"),
    "csgd-paperlam": (["--lambda-schedule", "paper"], "paper lambda 0.4*(E-e)/E"),
    "csgd-fixednoise": (["--noise", "fixed"], "fixed U(-0.1, 0.1) noise (paper)"),
    "csgd-bf16": (["--bf16"], "CSGD with bf16 autocast (fp32 weights and optimiser): the same drafter, faster where "
                              "the CPU computes bf16 natively?"),
}


def worker(args) -> int:
    """Train one variant, then score several trees on its held-out rank profiles (in its own process)."""
    import torch

    torch.set_num_threads(1)
    out = os.path.join(args.work, args.worker)
    flags, _ = VARIANTS[args.worker]
    from falcon_vllm import cli
    rc = cli.main(["train", "--data", args.data, "--out", out, "--fusion", "fc", "--k", "2", "--epochs",
                   str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--threads", "1",
                   "--save-dtype", "bfloat16", "--eval-roots", "60"] + flags)
    if rc:
        return rc
    rescore(args, args.worker)
    return 0


TREES = {2: ["falcon-llama", "falcon-vicuna", "chain-4", "chain-6", "chain-8"],
         1: ["eagle-small", "eagle-medium", "chain-4", "chain-6", "chain-8"]}


def sim_tau_trees(drafter, samples, names, max_roots: int = 240):
    """Held-out simulated tau of several trees from one set of true-path rank profiles (top-20, depth 8), the
    roots spread over the conversations as in the trainer's evaluation (``train.evaluation.root_profiles``)."""
    import torch

    from falcon_vllm.train.evaluation import root_profiles
    from falcon_vllm.tree import build_tree
    from falcon_vllm.acceptance import accepted_length, mean_tau, standard_error

    k = drafter.config.k
    trees = {n: build_tree(n, k) for n in names}
    depth = max(t.max_depth for t in trees.values())
    with torch.inference_mode():
        profs = root_profiles(drafter, samples, k, depth, 20, max_roots, "cpu")
    out = {"roots": len(profs)}
    for n, t in trees.items():
        nodes = set(t.nodes)
        acc = [accepted_length(p, nodes) for p in profs]
        out[n] = {"sim_tau": round(mean_tau(acc), 4), "sim_tau_se": round(standard_error(acc), 4),
                  "nodes": t.num_nodes, "drafter_passes": t.num_passes, "accepted": acc}
    return out


def paired_diff(a, b):
    """Mean and standard error of a - b over the same held-out roots (None when the roots differ)."""
    from falcon_vllm.acceptance import standard_error

    if not a or len(a) != len(b):
        return None
    d = [x - y for x, y in zip(a, b)]
    return sum(d) / len(d), standard_error(d)


def rescore(args, name) -> None:
    """Recompute a finished variant's eval_trees.json (older runs stored no per-root acceptance)."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from falcon_vllm.drafter import FalconDrafter
    from falcon_vllm.models import model_path
    from falcon_vllm.train.gen_data import load_shards
    from falcon_vllm.train.data import crop_context, split_held_out

    out = os.path.join(args.work, name)
    target = AutoModelForCausalLM.from_pretrained(str(model_path()), dtype=torch.float32).eval()
    d = FalconDrafter.from_pretrained(out, target.config).attach_target(target.get_input_embeddings(),
                                                                        target.get_output_embeddings())
    val = [crop_context(s, 128) for s in split_held_out(load_shards(args.data))[1]]
    with open(os.path.join(out, "eval_trees.json"), "w") as f:
        json.dump(sim_tau_trees(d, val, TREES[d.config.k]), f)


def prepare_teacher(data_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from falcon_vllm.models import model_path
    from falcon_vllm.train.gen_data import load_shards
    from falcon_vllm.train.data import cached_teacher

    target = AutoModelForCausalLM.from_pretrained(str(model_path()), dtype=torch.float32).eval()
    with torch.inference_mode():
        cached_teacher(data_dir, load_shards(data_dir), target.get_output_embeddings(), 64)


def run_variant(name, args):
    out = os.path.join(args.work, name)
    if os.path.exists(os.path.join(out, "eval_trees.json")):
        return name, 0
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--data", args.data, "--work", args.work,
           "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr)]
    with open(os.path.join(args.work, name + ".log"), "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    return name, rc


def report(args, names):
    rows, base = [], None
    for name in names:
        out = os.path.join(args.work, name)
        try:
            res = json.load(open(os.path.join(out, "training_log.json")))
            trees = json.load(open(os.path.join(out, "eval_trees.json")))
            cfg = json.load(open(os.path.join(out, "config.json")))
        except FileNotFoundError:
            continue
        if "accepted" not in trees["chain-4"]:
            rescore(args, name)
            trees = json.load(open(os.path.join(out, "eval_trees.json")))
        own = trees[cfg["falcon"].get("tree")]
        if name == "csgd":
            base = own["accepted"]
        diff = paired_diff(own["accepted"], base) if base is not None else None
        fin = res["final"]
        tr = dict(cfg["falcon"].get("extra", {}).get("training", {}))
        tr.pop("heldout", None)
        rows.append({"variant": name, "what": VARIANTS[name][1], "k": cfg["falcon"]["k"],
                     "tree": cfg["falcon"].get("tree"), "top1_by_block_position": fin["top1_by_block_position"],
                     "sim_tau_tree": own["sim_tau"], "sim_tau_tree_se": own["sim_tau_se"],
                     "sim_tau_tree_minus_csgd": None if diff is None else [round(diff[0], 4), round(diff[1], 4)],
                     "sim_tau_chain4": trees["chain-4"]["sim_tau"],
                     "sim_tau_trees": {n: {k: x for k, x in v.items() if k != "accepted"}
                                       for n, v in trees.items() if n != "roots"}, "sim_roots": trees["roots"],
                     "steps": fin["steps"], "train_seconds": fin["seconds"], "training": tr,
                     "history": [{"epoch": h["epoch"], "sim_tau": h["sim_tau"],
                                  "top1": h["top1_by_block_position"]} for h in res["history"]]})
    man = json.load(open(os.path.join(args.data, "manifest.json")))
    meta = {"data": {"conversations": sum(s["conversations"] for s in man["shards"]),
                     "max_new_tokens": man.get("max_new_tokens"), "generation": man.get("generation")},
            "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
            "command": "python benchmarks/train_ablation.py " + " ".join(
                a for a in sys.argv[1:] if not a.startswith("/") and a != "--report-only"),
            "rows": rows}
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, args.name + ".json"), "w") as f:
        json.dump(meta, f, indent=1)
    md = [f"# {args.name}: drafter training ablation (SmolLM2-135M-Instruct target)", "",
          f"Data: {meta['data']['conversations']} ShareGPT first turns regenerated greedily by the target "
          f"(<= {meta['data']['max_new_tokens']} new tokens), last 1/16 held out. Every variant: 1 decoder "
          f"layer, fc fusion, {args.epochs} epochs x batch {args.batch_size}, AdamW lr {args.lr}, same seed. "
          "Held-out metrics: top-1 = drafter argmax equals the target's argmax, per position r of the k-block; "
          "sim tau = 1 + mean accepted length of the tree drafted from true target features at held-out "
          "answer positions (bonus token included), +- its standard error; 'minus csgd' is the paired "
          "difference over the same roots (mean +- standard error): a difference inside 2 standard errors "
          "does not rank two variants.", "",
          "| variant | k | top-1 by block position | sim tau (own tree) | minus csgd | sim tau chain-4 | steps | "
          "train s | what |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["sim_tau_tree_minus_csgd"]
        md.append(f"| {r['variant']} | {r['k']} | {', '.join(f'{x:.3f}' for x in r['top1_by_block_position'])} | "
                  f"{r['sim_tau_tree']:.3f} +- {r['sim_tau_tree_se']:.3f} ({r['tree']}) | "
                  f"{'-' if d is None or r['variant'] == 'csgd' else f'{d[0]:+.3f} +- {d[1]:.3f}'} | "
                  f"{r['sim_tau_chain4']:.3f} | {r['steps']} | {r['train_seconds']:.0f} | {r['what']} |")
    md += ["", "Held-out simulated tau per tree (same rank profiles: top-20, depth 8; nodes = tree size):", "",
           "| variant | " + " | ".join(f"tree {i}" for i in range(5)) + " |", "|---|" + "---|" * 5]
    for r in rows:
        md.append(f"| {r['variant']} | " + " | ".join(f"{n} ({v['nodes']} nodes): {v['sim_tau']:.3f}"
                                                    for n, v in r["sim_tau_trees"].items()) + " |")
    md += ["", "Held-out sim tau of the variant's own tree after each epoch:", ""]
    for r in rows:
        md.append(f"- {r['variant']}: " + ", ".join(f"{h['sim_tau']:.2f}" for h in r["history"]))
    with open(os.path.join(args.results, args.name + ".md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--only", default=None, help="comma-separated variant names (default: all, in order)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--name", default="ablation_smollm2")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    names = args.only.split(",") if args.only else list(VARIANTS)
    os.makedirs(args.work, exist_ok=True)
    if not args.report_only:
        t0 = time.time()
        prepare_teacher(args.data)  # once, before the parallel workers read it
        with ThreadPoolExecutor(args.parallel) as ex:
            for name, rc in ex.map(lambda n: run_variant(n, args), names):
                print(f"{name}: rc={rc} ({time.time() - t0:.0f} s)", flush=True)
    report(args, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
