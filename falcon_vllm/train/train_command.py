"""``falcon-vllm train``: one training run from its flags, or a whole known recipe (``--recipe``, with ``--status``
to say where its run stands).  The training flags are generated from :class:`falcon_vllm.train.config.TrainConfig`;
the recipes are :mod:`falcon_vllm.train.recipes`.
"""

from __future__ import annotations

import json
import os

import torch

from falcon_vllm.train.config import add_config_arguments, config_from_args
from falcon_vllm.train.recipe_status import recipe_status
from falcon_vllm.train.recipes import RECIPE_FALCON_FLAGS, RECIPES, run_recipe
from falcon_vllm.train.trainer import train


def add_arguments(p):
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="run a whole known recipe into --work (gen-data, the Falcon drafter and its EAGLE-1 baseline "
                        "on the same data; smollm2 installs both into falcon_vllm/drafters/, qwen2.5-coder-1.5b "
                        "fits the Falcon drafter's serving.json and installs nothing); resumable")
    p.add_argument("--work", default=".cache/drafter-run", help="working directory of --recipe")
    p.add_argument("--status", action="store_true",
                   help="with --recipe: say where the run in --work stands (data, teacher caches, each training "
                        "stage, the trees) and what it resumes next; runs nothing")
    p.add_argument("--no-baseline", action="store_true",
                   help="with --recipe: train the Falcon drafter alone, without its EAGLE-1 baseline (about half the "
                        "training time); the same command without it later trains the baseline")
    p.add_argument("--sets", type=int, default=None, metavar="N",
                   help="with --recipe: a new run trains on the recipe's first N data sets only, and the stages on "
                        "them (an earlier stage's drafter hours sooner); a run keeps the sets it began with "
                        "(<work>/recipe_sets.json): a later --work linking this one's trains on more")
    p.add_argument("--no-install", action="store_true",
                   help="with --recipe: leave the trained drafters in --work instead of installing them into "
                        "falcon_vllm/drafters/ (e.g. a variant of the recipe: --recipe smollm2 --glance none)")
    add_config_arguments(p)
    p.add_argument("--threads", type=int, default=None)


def recipe_overrides(args) -> dict:
    """The Falcon-stage flags (RECIPE_FALCON_FLAGS) given with --recipe; any other training flag given there would
    be ignored by the recipe's own settings, so it is refused.  ``args.given``: the options given (``falcon-vllm
    train`` sets it: falcon_vllm.cli.given_options); without it, those whose value differs from the default."""
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    defaults = vars(p.parse_args([]))
    # what --recipe itself takes (besides RECIPE_FALCON_FLAGS)
    kept = ("work", "device", "threads", "no_install", "no_baseline", "sets", "status")
    given = getattr(args, "given", None)
    given = {k: v for k, v in vars(args).items() if k in defaults and k not in kept and k != "recipe"
             and (k in given if given is not None else v != defaults[k])}
    ignored = sorted(k for k in given if k not in RECIPE_FALCON_FLAGS)
    if ignored:
        def flags(names):
            return ", ".join("--" + n.replace("_", "-") for n in names)

        raise SystemExit(f"falcon-vllm: train: --recipe runs the recipe's own settings; it takes {flags(kept)} and, "
                         f"for its Falcon stages, {flags(RECIPE_FALCON_FLAGS)}; given too: {flags(ignored)}")
    return {k: v for k, v in given.items() if k in RECIPE_FALCON_FLAGS}


def main(args):
    from falcon_vllm.models import model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.status and not args.recipe:
        raise SystemExit("falcon-vllm: train: --status applies to --recipe only")
    if args.status:
        print("\n".join(recipe_status(args.recipe, args.work, args.sets)))
        return 0
    if args.recipe:
        print(json.dumps(run_recipe(args.recipe, args.work, install=not args.no_install, device=args.device,
                                    falcon_overrides=recipe_overrides(args), baseline=not args.no_baseline,
                                    num_sets=args.sets), indent=1))
        return 0
    for flag in ("no_install", "no_baseline", "sets"):
        if (value := getattr(args, flag)) is not None and value is not False:
            raise SystemExit(f"falcon-vllm: train: --{flag.replace('_', '-')} applies to --recipe only")
    if not args.data or not args.out:
        raise SystemExit("falcon-vllm: train: --data and --out are required (or --recipe)")
    res = train(config_from_args(args, target_dir=args.target or str(model_path())))
    if res.get("stopped"):
        state = res["state"]
        print(f"falcon-vllm: train: stopped after epoch {state['epoch']} (step {state['step']}); the same command "
              f"without --stop-after-epochs continues from {os.path.join(args.out, 'checkpoint.pt')}")
        return 0
    if res["final"] is None:  # not rank 0
        return 0
    with open(os.path.join(args.out, "training_log.json"), "w") as f:
        json.dump({n: v for n, v in res.items() if n != "drafter"}, f, indent=1)
    print(json.dumps(res["final"]))
    return 0
