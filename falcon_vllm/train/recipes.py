"""``falcon-vllm train``: one training run from its flags, or a whole known recipe (``--recipe``).

A recipe is one command from nothing to installed drafters: gen-data for the target, the Falcon drafter
(CSGD) and its EAGLE-1 baseline, each trained in stages (each later stage continues the one before with a
new optimiser and schedule), the datastore of the answers trained on, and the drafters installed into
``falcon_vllm/drafters/``.  Every step resumes where it stopped.  The training flags are generated from
:class:`falcon_vllm.train.config.TrainConfig`.
"""

from __future__ import annotations

import json
import os
import time

import torch

from falcon_vllm.config import dir_name
from falcon_vllm.train import gen_data
from falcon_vllm.train.config import TrainConfig, add_config_arguments, config_from_args
from falcon_vllm.train.trainer import train

RECIPES = {
    # SmolLM2-135M-Instruct on a 2-core CPU: gen-data through vLLM (8192 ShareGPT first turns x up to 160
    # greedy tokens; featurized from the stored answers in about an hour, about 30 min per 2048 conversations
    # when generated), then the Falcon drafter (k=2, fc fusion, CSGD, 2 decoder layers, reversed block order)
    # and the EAGLE-1 baseline (1 layer) in the same stages, on the same data with the same truncated head.
    # Held out: the last 1/16 of the data (conversations 7680-8191).
    "smollm2": {"num_conversations": 8192, "max_new_tokens": 160, "shard_size": 128, "backend": "vllm",
                "epochs": 5, "batch_size": 8, "lr": 2e-3, "fusion": "fc", "k": 2, "tree": "falcon-llama",
                "falcon_layers": 2, "falcon_block_order": "reversed", "draft_vocab": 8192,
                "falcon_dir": "smollm2-135m-instruct", "eagle_dir": "smollm2-135m-instruct-eagle",
                "eagle_tree": "eagle-small",
                "answers": "smollm2-sharegpt.safetensors",
                # stage 1: the first 3,360 conversations, 5 epochs (the draft head's tokens come from them)
                "max_conversations": 3360,
                # each later stage: a new schedule from the weights before; stage 2: the same conversations,
                # 4 epochs, lr 1e-3; stage 3: the first 5,280, 2 epochs; stage 4: all 7,680, 3 epochs; stage 5:
                # all 7,680 again, 2 epochs at lr 3e-4 (a restart at 1e-3 first costs accuracy)
                "continue": [{"epochs": 4, "lr": 1e-3}, {"epochs": 2, "lr": 1e-3, "max_conversations": 5280},
                             {"epochs": 3, "lr": 1e-3, "max_conversations": None},
                             {"epochs": 2, "lr": 3e-4, "max_conversations": None}]},
}

# the flags a recipe run takes from the command line for its Falcon stages (a variant of the recipe to compare)
RECIPE_FALCON_FLAGS = ("glance", "block_phase")


def run_recipe(name: str, work: str, install: bool = True, device: str = "cpu", log=print,
               falcon_overrides: dict | None = None) -> dict:
    """gen-data + Falcon (CSGD) + EAGLE baseline for a known target; installs into falcon_vllm/drafters.
    Every step resumes where it stopped (gen-data by shard, training by epoch).  ``falcon_overrides``: TrainConfig
    fields (``RECIPE_FALCON_FLAGS``) that every Falcon stage takes instead of the recipe's."""
    from falcon_vllm.models import model_path

    r = RECIPES[name]
    falcon_overrides = dict(falcon_overrides or {})
    if unknown := sorted(set(falcon_overrides) - set(RECIPE_FALCON_FLAGS)):
        raise ValueError(f"falcon-vllm: train --recipe: only {', '.join(RECIPE_FALCON_FLAGS)} can be changed for the "
                         f"Falcon stages, not {unknown}")
    target_dir = str(model_path())
    data = os.path.join(work, "data")
    t0 = time.time()
    answers = recipe_data(r, target_dir, data, log)
    t_data = time.time() - t0
    common = dict(data_dir=data, target_dir=target_dir, epochs=r["epochs"], batch_size=r["batch_size"], lr=r["lr"],
                  draft_vocab=r["draft_vocab"], save_dtype="bfloat16", device=device,
                  max_conversations=r.get("max_conversations"))
    fal = train_stages(r, os.path.join(work, "falcon"), log, k=r["k"], fusion=r["fusion"], tree=r["tree"],
                       layers=r.get("falcon_layers", 1), block_order=r.get("falcon_block_order", "forward"),
                       **{**common, "epochs": r.get("falcon_epochs", r["epochs"])}, **falcon_overrides)
    eag = train_stages(r, os.path.join(work, "eagle"), log, mode="eagle", tree=r["eagle_tree"], **common)
    save_datastore(r, fal["out"], answers, data, work)
    out = {"recipe": name, "device": device, "gen_data_seconds": round(t_data, 1), "falcon": fal["final"],
           "eagle": eag["final"], "falcon_overrides": falcon_overrides,
           "total_seconds": round(time.time() - t0, 1)}
    if install:
        shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafters")
        install_drafter(fal["out"], os.path.join(shipped, r["falcon_dir"]),
                        files=("config.json", "model.safetensors", "datastore.npz"))
        install_drafter(os.path.join(eag["out"], "vllm-eagle"), os.path.join(shipped, r["eagle_dir"]))
        out["installed"] = [r["falcon_dir"], r["eagle_dir"]]
    with open(os.path.join(work, "recipe_log.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def recipe_data(r: dict, target_dir: str, data: str, log) -> str:
    """gen-data for recipe ``r`` into ``data``: featurized from the recipe's stored answers (in the source tree)
    where they are, generated otherwise.  Returns the answers file's path (it may not exist)."""
    import importlib.util

    backend = r["backend"]
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        log("vLLM is not installed here: gen-data answers with transformers' generate (slower, same data)")
        backend = "hf"
    # the recipe's conversations as generated before (tokens only, in the source tree): featurized, not generated
    answers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "answers", r["answers"])
    gen_data.run(target_dir, data, r["num_conversations"], r["max_new_tokens"], shard_size=r["shard_size"],
                 backend=backend, answers=answers if os.path.exists(answers) else None)
    return answers


def train_stages(r: dict, out: str, log, **kw) -> dict:
    """Train recipe ``r``'s stages of one drafter (``TrainConfig`` fields ``kw``) into ``out``, ``out-stage2``, ..;
    each later stage continues the one before (new optimiser and schedule).  Returns the last stage's result."""
    res, prev = None, None
    for i, stage in enumerate([{}] + r.get("continue", [])):
        d = out if i == 0 else f"{out}-stage{i + 1}"
        res = train(TrainConfig(d, **{**kw, **stage, "init_from": prev}), log=log)
        prev = d
    return res


def save_datastore(r: dict, drafter_dir: str, answers: str, data: str, work: str) -> None:
    """``datastore.npz`` in ``drafter_dir``: the target's answers the drafter trained on, for serving's retrieval
    drafts (:mod:`falcon_vllm.datastore`); from the recipe's answers file, or one written from ``data``."""
    from falcon_vllm.datastore import from_answers_file

    if not os.path.exists(answers):
        answers = os.path.join(work, "answers.safetensors")
        gen_data.save_answers(data, answers)
    os.makedirs(drafter_dir, exist_ok=True)
    from_answers_file(answers, r["num_conversations"])[0].save(os.path.join(drafter_dir, "datastore.npz"))


def install_drafter(src: str, dst: str, files=("config.json", "model.safetensors")) -> None:
    """Copy a trained drafter's ``files`` from ``src`` into ``dst``, its config naming the target by name only."""
    import shutil

    os.makedirs(dst, exist_ok=True)
    for f in files:
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    tgt = cfg.get("falcon", {}).get("target", {})
    if "name" in tgt:  # record the target's name, not where it lay on the training machine
        tgt["name"] = dir_name(tgt["name"])
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def add_arguments(p):
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="run a whole known recipe (gen-data, Falcon drafter, EAGLE baseline) into --work and "
                        "install the drafters into falcon_vllm/drafters/; resumable")
    p.add_argument("--work", default=".cache/drafter-run", help="working directory of --recipe")
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
    kept = ("work", "device", "threads", "no_install")  # what --recipe itself takes (besides RECIPE_FALCON_FLAGS)
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
    if args.recipe:
        print(json.dumps(run_recipe(args.recipe, args.work, install=not args.no_install, device=args.device,
                                    falcon_overrides=recipe_overrides(args)), indent=1))
        return 0
    if args.no_install:
        raise SystemExit("falcon-vllm: train: --no-install applies to --recipe only")
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
