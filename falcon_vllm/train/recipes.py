"""The training recipes of ``falcon-vllm train --recipe`` (the command: :mod:`falcon_vllm.train.train_command`).

A recipe is one command from nothing to trained drafters: gen-data for the target, the Falcon drafter
(CSGD) and its EAGLE-1 baseline, each trained in stages (each later stage continues the one before with a
new optimiser and schedule) on the same data with the same head, then what the shipped drafter serves with (the
datastore of the answers trained on, or a tree fitted by ``tune-tree``), and the drafters installed into
``falcon_vllm/drafters/`` where the recipe says so.  Every step resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import time

from falcon_vllm.config import dir_name
from falcon_vllm.train import gen_data
from falcon_vllm.train.answer_files import answers_meta
from falcon_vllm.train.config import TrainConfig
from falcon_vllm.train.grow import answers_only
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
    # Qwen2.5-Coder-1.5B-Instruct (drafters v3 and on): every stored answer of the target (tokens in the source tree,
    # featurized by a prefill through vLLM) and the answers a set's file still lacks (answered through vLLM, the
    # states kept while answering, the file growing shard by shard), the Falcon drafter of the shipped v2 (k=2, fc
    # fusion, 1 layer with its MLP narrowed to 3,584, reversed block order, frozen 16,384-token head, lr 4e-4:
    # a 1,536-wide drafter diverged at 1e-3) and the EAGLE-1 baseline in the same four stages, then the tree
    # fitted by tune-tree to the held-out rank profile and vLLM's step cost (the drafter's serving.json).  The
    # first set is --data (its last 1/16 held out: the same 60 conversations as v2's); the others are
    # --extra-data.  Not installed: it replaces the shipped drafter only after a same-run A/B against it.  A run
    # keeps the sets it began with (drafter v3's: the first three).
    "qwen2.5-coder-1.5b": {
        # shards of 64: those `gen-data --answers-only FILE --out <work>/data/<set>` writes while growing a set
        "target": "qwen2.5-coder-1.5b-instruct", "max_new_tokens": 256, "shard_size": 64, "backend": "vllm",
        "featurizer": "vllm",
        "sets": [{"name": "qwen15", "answers": "qwen15-sharegpt.safetensors", "num_conversations": 960},
                 {"name": "qwen15-code", "answers": "qwen15-code.safetensors",
                  "questions": "qwen15-code-questions.json", "num_conversations": 918},
                 # the rest of ShareGPT's usable first turns: answered by the recipe where the file lacks them (third:
                 # its states are kept while it is answered, so a run of the first three sets, drafter v3's, trains
                 # without the prefill of the fourth's 3,840, about 2.4 h on a 2-core CPU)
                 {"name": "qwen15-sharegpt-from5136", "answers": "qwen15-sharegpt-from5136.safetensors",
                  "skip_conversations": 5136, "num_conversations": 4228},
                 {"name": "qwen15-sharegpt-from1296", "answers": "qwen15-sharegpt-from1296.safetensors",
                  "skip_conversations": 1296},  # no count: every conversation the file holds when the run first starts
                 # the second turns of those conversations (about 68% have a second question): each first-turn file
                 # continued, only the second answers generated and trained; not the 336 first turns past the first
                 # set's 960, which no stage trains on (held-out evaluations read them)
                 *({"name": f"{name}-turn2", "answers": f"{name}-turn2.safetensors", "continues": f"{name}.safetensors",
                    "max_turns": 2, "loss_from_turn": 2, "skip_conversations": skip, "num_conversations": n}
                   for name, skip, n in (("qwen15-sharegpt", 0, 960), ("qwen15-sharegpt-from1296", 1296, 3840),
                                         ("qwen15-sharegpt-from5136", 5136, 4228)))],
        "epochs": 5, "batch_size": 8, "lr": 4e-4, "fusion": "fc", "k": 2, "tree": "falcon-llama",
        "falcon_block_order": "reversed", "draft_vocab": 16384, "eagle_tree": "eagle-small",
        "train": {"intermediate_size": 3584, "train_draft_head": False, "eval_every_epoch": False},
        "datastore": False, "install": False,
        "tune_tree": ["--num-prompts", "39", "--batch-sizes", "1,2,4", "--widths", "2,3,4,6,8,12"],
        "falcon_dir": "qwen2.5-coder-1.5b-instruct", "eagle_dir": "qwen2.5-coder-1.5b-instruct-eagle",
        # stages 1-2 on the first three sets (drafter v3), stage 3 from those weights on the first four (every first
        # turn), stage 4 on every set (the second turns too); held-out metrics after each epoch of stages 3-4:
        # whether more epochs would pay
        "train_sets": 3, "continue": [{"epochs": 3, "lr": 2e-4},
                                      {"epochs": 3, "lr": 2e-4, "train_sets": 4, "eval_every_epoch": True},
                                      {"epochs": 3, "lr": 2e-4, "train_sets": None, "eval_every_epoch": True}]},
}

ANSWERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "answers")  # the stored answers files

# the flags a recipe run takes from the command line for its Falcon stages (a variant of the recipe to compare)
RECIPE_FALCON_FLAGS = ("glance", "block_phase")


def run_recipe(name: str, work: str, install: bool = True, device: str = "cpu", log=print,
               falcon_overrides: dict | None = None, baseline: bool = True, num_sets: int | None = None) -> dict:
    """gen-data + Falcon (CSGD) + EAGLE baseline for a known target, then what the Falcon drafter serves with;
    installs into falcon_vllm/drafters where the recipe does.  Every step resumes where it stopped (gen-data by
    shard, training from its checkpoint, a tree already fitted is kept).  ``falcon_overrides``: TrainConfig fields
    (``RECIPE_FALCON_FLAGS``) that every Falcon stage takes instead of the recipe's.  ``baseline=False``: the Falcon
    drafter alone (no EAGLE-1 baseline: about half the training); a later run with it trains the baseline.
    ``num_sets``: a new run trains on the recipe's first ``num_sets`` data sets only (``run_sets``)."""
    from falcon_vllm.models import model_path

    r = RECIPES[name]
    falcon_overrides = dict(falcon_overrides or {})
    if unknown := sorted(set(falcon_overrides) - set(RECIPE_FALCON_FLAGS)):
        raise ValueError(f"falcon-vllm: train --recipe: only {', '.join(RECIPE_FALCON_FLAGS)} can be changed for the "
                         f"Falcon stages, not {unknown}")
    target_dir = str(model_path(r["target"]) if "target" in r else model_path())
    t0 = time.time()
    dirs, answers = recipe_data(r, target_dir, work, log, num_sets)
    data = dirs[0]
    t_data = time.time() - t0
    common = dict(data_dir=data, target_dir=target_dir, epochs=r["epochs"],
                  batch_size=r["batch_size"], lr=r["lr"], draft_vocab=r["draft_vocab"], save_dtype="bfloat16",
                  device=device, bf16=train_bf16(device), max_conversations=r.get("max_conversations"),
                  **r.get("train", {}))
    fal = train_stages(r, os.path.join(work, "falcon"), dirs, log, **drafter_settings(r, "falcon"),
                       **{**common, "epochs": r.get("falcon_epochs", r["epochs"])}, **falcon_overrides)
    files = ["config.json", "model.safetensors"]
    if "tune_tree" in r:  # before the baseline trains: the Falcon drafter is whole (and can be A/B'd) hours earlier
        fit_tree(r, target_dir, fal["out"], data, log)
        files.append("serving.json")
    eag = train_stages(r, os.path.join(work, "eagle"), dirs, log, **drafter_settings(r, "eagle"), **common) \
        if baseline else None
    if r.get("datastore", True):
        save_datastore(r, fal["out"], answers, data, work)
        files.append("datastore.npz")
    out = {"recipe": name, "device": device, "gen_data_seconds": round(t_data, 1), "falcon": fal["final"],
           "eagle": eag and eag["final"], "baseline": baseline, "falcon_overrides": falcon_overrides,
           "total_seconds": round(time.time() - t0, 1),
           "drafters": [fal["out"]] + ([os.path.join(eag["out"], "vllm-eagle")] if eag else [])}
    if install and r.get("install", True):
        shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafters")
        install_drafter(fal["out"], os.path.join(shipped, r["falcon_dir"]), files=tuple(files))
        out["installed"] = [r["falcon_dir"]]
        if eag:
            install_drafter(os.path.join(eag["out"], "vllm-eagle"), os.path.join(shipped, r["eagle_dir"]))
            out["installed"].append(r["eagle_dir"])
    elif install:
        log(f"falcon-vllm: train --recipe {name}: the drafters stay in {work} (this recipe installs nothing): "
            f"A/B it against the shipped falcon_vllm/drafters/{r['falcon_dir']} in one run (python "
            f"benchmarks/ab_step.py --model {target_dir} --configs vanilla,falcon,falcon@{fal['out']}), and copy "
            f"its {', '.join(files)} there if it wins")
    with open(os.path.join(work, "recipe_log.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def drafter_settings(r: dict, mode: str) -> dict:
    """The TrainConfig fields that recipe ``r`` sets for one drafter only: its Falcon drafter's or (``mode``
    "eagle") its EAGLE-1 baseline's."""
    if mode == "eagle":
        return dict(mode="eagle", tree=r["eagle_tree"])
    return dict(k=r["k"], fusion=r["fusion"], tree=r["tree"], layers=r.get("falcon_layers", 1),
                block_order=r.get("falcon_block_order", "forward"))


def train_bf16(device: str) -> bool:
    """Whether a recipe's stages train with bf16 autocast (fp32 weights and optimiser): where ``device`` computes
    bf16 natively, a GPU or a CPU with AVX512-BF16 or AMX (a step of the Qwen drafter 1.8-2.0x faster than fp32 on
    AVX512-BF16, the same held-out top-1: training_bf16_smollm2); not where bf16 is emulated (26x slower).  The same
    rule as the features' dtype (``gen-data --featurize-dtype auto``)."""
    from falcon_vllm.vllm.capture import cpu_bf16  # imports no vLLM

    return device.startswith("cuda") or (device == "cpu" and cpu_bf16())


def recipe_data(r: dict, target_dir: str, work: str, log, num_sets: int | None = None) -> tuple[list[str], str]:
    """gen-data for recipe ``r`` under ``work/data``: each set of the run (``run_sets``) featurized from its stored
    answers (in the source tree); what the sets' answers files lack is answered first, into those files, before
    any set is featurized (the answers are what a lost machine keeps; their states are kept while answering where
    the featurizer is vLLM).  Returns the sets' directories (the first is ``--data``: its last 1/16 held out; the
    others ``--extra-data``) and the first set's answers file."""
    import importlib.util

    backend = r["backend"]
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        log("vLLM is not installed here: gen-data answers with transformers' generate (slower, same data)")
        backend = "hf"
    featurizer = r.get("featurizer", "hf") if backend == "vllm" else "hf"
    sets = run_sets(r, work, log, num_sets)
    dirs, files = [], []
    # each set's conversations as answered before (tokens only, in the source tree) are featurized, not answered
    # again; every count fixed before the first set starts (a growing file's as it is now)
    counts = [s.get("num_conversations") or pinned_count(work, s["name"], os.path.join(ANSWERS, s["answers"]), log)
              for s in sets]
    # what the sets' answers files lack is answered first: the answers (tokens, in the source tree) are what
    # survives a lost machine; with the vLLM featurizer the states are kept while answering
    for s, n in zip(sets, counts):
        answers = os.path.join(ANSWERS, s["answers"])
        if (missing := n - held(answers)) > 0 and backend == "vllm":
            log(f"{s['name']}: answering the {missing} of its {n} conversations that {s['answers']} lacks")
            answers_only(target_dir, answers, n, r["max_new_tokens"], r["shard_size"], data=questions(s),
                         skip_conversations=s.get("skip_conversations", 0),
                         out_dir=set_dir(work, s) if featurizer == "vllm" else None, continues=continued(s),
                         **turns(s))
    for s, n in zip(sets, counts):
        answers = os.path.join(ANSWERS, s["answers"])
        hf_answers = backend != "vllm" and n > held(answers)  # gen-data answers them, into the file
        source = answers if os.path.exists(answers) else None
        if continued(s) and hf_answers:  # the first turns, continued (and saved into the set's file)
            source = continued(s)
        gen_data.run(target_dir, set_dir(work, s), n, r["max_new_tokens"], shard_size=r["shard_size"],
                     backend=backend, answers=source, data=questions(s),
                     skip_conversations=s.get("skip_conversations", 0), featurizer=featurizer,
                     save_answers_to=answers if hf_answers else None, **turns(s))
        dirs.append(set_dir(work, s))
        files.append(answers)
    return dirs, files[0]


def questions(s: dict) -> str | None:
    """Set ``s``'s prompts file (ShareGPT JSON in the answers directory), None for ShareGPT itself."""
    return os.path.join(ANSWERS, s["questions"]) if "questions" in s else None


def turns(s: dict) -> dict:
    """Set ``s``'s turns: a set that ``continues`` another's answers file answers its later turns (``max_turns``),
    trained from turn ``loss_from_turn``; every other set, first turns."""
    return {"max_turns": s.get("max_turns", 1), "loss_from_turn": s.get("loss_from_turn", 1)}


def continued(s: dict) -> str | None:
    """The answers file whose conversations set ``s`` continues to later turns (None: a set of first turns)."""
    return os.path.join(ANSWERS, s["continues"]) if "continues" in s else None


def held(answers: str) -> int:
    """The conversations an answers file holds (0 where there is none yet)."""
    return int(answers_meta(answers)["conversations"]) if os.path.exists(answers) else 0


def recipe_sets(r: dict) -> list[dict]:
    """Recipe ``r``'s data sets (``name``, ``answers`` file, ``num_conversations`` where fixed, ...); a recipe of one
    set names it by its top-level keys."""
    return r.get("sets") or [{"name": "", "answers": r["answers"], "num_conversations": r["num_conversations"]}]


def set_dir(work: str, s: dict) -> str:
    """Where a recipe run in ``work`` writes set ``s``'s gen-data directory."""
    return os.path.join(work, "data", s["name"]) if s["name"] else os.path.join(work, "data")


def read_pins(work: str) -> dict:
    """What ``<work>/recipe_sets.json`` fixed when the run first started: ``sets``, the names of the sets it trains
    on (None before it was kept), and ``counts``, the conversations of each set without a count."""
    raw = read_json(os.path.join(work, "recipe_sets.json")) or {}
    if "sets" in raw or "counts" in raw:
        return {"sets": raw.get("sets"), "counts": raw.get("counts", {})}
    return {"sets": None, "counts": raw}  # written before the run kept its sets: the counts alone


def write_pins(work: str, pins: dict) -> None:
    path = os.path.join(work, "recipe_sets.json")
    os.makedirs(work, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(pins, f, indent=1)
    os.replace(path + ".tmp", path)


def run_sets(r: dict, work: str, log, num_sets: int | None = None) -> list[dict]:
    """The sets of recipe ``r`` that the run in ``work`` trains on (``began_with``), fixed in
    ``<work>/recipe_sets.json`` when it first starts, so that a run resumed under a newer recipe with more sets (its
    stages take hours) trains both drafters on the data it began with; a new --work trains on them all, or on the
    first ``num_sets`` (``--sets``: the drafter of an earlier stage hours sooner, a later --work linking it)."""
    pins = read_pins(work)
    if pins["sets"] is not None and (gone := [n for n in pins["sets"] if n not in {s["name"] for s in recipe_sets(r)}]):
        raise SystemExit(f"falcon-vllm: train --recipe: the run in {work} began with the sets {pins['sets']}; this "
                         f"recipe no longer has {gone}: finish it with the version of falcon-vllm that began it, or "
                         f"start a new --work")
    sets = began_with(r, work, pins, num_sets)
    if pins["sets"] is None:
        write_pins(work, {**pins, "sets": [s["name"] for s in sets]})
    elif added := [s["name"] for s in recipe_sets(r) if s not in sets]:
        log(f"{', '.join(added)}: not in the run in {work} (it began without them): a new --work trains on them")
    return sets


def began_with(r: dict, work: str, pins: dict, num_sets: int | None = None) -> list[dict]:
    """The sets of recipe ``r`` the run in ``work`` began with (``pins``: ``read_pins``): those its pins name; every
    set for a new run (its first ``num_sets`` where given); a run begun before its sets were kept (its file holds
    counts alone): the sets it has begun.  ``num_sets`` (``--sets``) is refused where it is out of the recipe's range
    or the run began with another number of sets."""
    sets = recipe_sets(r)
    if num_sets is not None and not 1 <= num_sets <= len(sets):
        raise SystemExit(f"falcon-vllm: train --recipe: --sets {num_sets}: this recipe has {len(sets)} data sets")
    if num_sets is not None and pins["sets"] is not None and len(pins["sets"]) != num_sets:
        raise SystemExit(f"falcon-vllm: train --recipe: the run in {work} began with {len(pins['sets'])} sets "
                         f"({', '.join(pins['sets'])}): --sets applies to a run when it first starts (start a new "
                         f"--work, or leave --sets out to resume this one)")
    if pins["sets"] is not None:
        return [s for s in sets if s["name"] in pins["sets"]]
    begun = [s for s in sets if os.path.exists(os.path.join(set_dir(work, s), "manifest.json"))]
    return begun if os.path.exists(os.path.join(work, "recipe_sets.json")) and begun else sets[:num_sets]


def pinned_count(work: str, name: str, answers: str, log) -> int:
    """The conversations of a recipe set without a count: every one its answers file holds when the run first
    starts, kept in ``<work>/recipe_sets.json``, so that the run resumed later (its stages take hours, and the
    file may have grown since) trains both drafters on the same data."""
    pins, now = read_pins(work), held(answers)
    if name not in pins["counts"]:
        pins["counts"][name] = now
        write_pins(work, pins)
    elif now != pins["counts"][name]:
        log(f"{name}: the {pins['counts'][name]} conversations this run began with "
            f"({os.path.join(work, 'recipe_sets.json')}); {os.path.basename(answers)} holds {now} now: a new --work "
            f"trains on them")
    return pins["counts"][name]


def fit_tree(r: dict, target_dir: str, drafter_dir: str, data: str, log) -> str:
    """``serving.json`` in ``drafter_dir``: the trees ``tune-tree`` fits per batch size to the drafter's rank
    profile on ``data``'s held-out conversations and to vLLM's step cost on this machine (kept if it exists)."""
    import argparse

    from falcon_vllm import tune_tree

    out = os.path.join(drafter_dir, "serving.json")
    if os.path.exists(out):
        log(f"{out} exists: kept (delete it to fit the trees again)")
        return out
    p = argparse.ArgumentParser()
    tune_tree.add_arguments(p)
    tune_tree.main(p.parse_args(["--target", target_dir, "--drafter", drafter_dir, "--data", data, "--out", out,
                                 *r["tune_tree"]]))
    return out


def train_stages(r: dict, out: str, dirs: list[str], log, **kw) -> dict:
    """Train recipe ``r``'s stages of one drafter (``TrainConfig`` fields ``kw``) into ``out``, ``out-stage2``, ..;
    each later stage continues the one before (new optimiser and schedule), on the first of the run's data sets
    ``dirs`` that ``stages`` gives it (the first held out in part, the others extra).  A stage whose drafter is
    written is kept as it is; one on sets the run began without is not trained (nor any after it).  Returns the
    last stage's result."""
    res, prev = None, None
    kept = run_stages(r, out, len(dirs))
    for d, _, _ in stages(r, out)[len(kept):]:
        log(f"{d}: on sets this run began without: not trained in it")
    for d, stage, n in kept:
        if os.path.exists(os.path.join(d, "model.safetensors")):
            log(f"{d}: trained (its drafter is written): kept")
            with open(os.path.join(d, "config.json")) as f:
                record = json.load(f).get("falcon", {}).get("extra", {}).get("training", {})
            res = {"final": record.get("heldout"), "out": d}
        else:
            extra = ",".join(dirs[1:n]) or None
            res = train(TrainConfig(d, **{**kw, **stage, "extra_data_dir": extra, "init_from": prev}), log=log)
        prev = d
    return res


def run_stages(r: dict, out: str, num_sets: int) -> list[tuple[str, dict, int]]:
    """``stages`` up to the first one on more sets than the run's ``num_sets`` (``train_stages`` stops there)."""
    kept = []
    for stage in stages(r, out):
        if stage[2] > num_sets:
            break
        kept.append(stage)
    return kept


def stages(r: dict, out: str) -> list[tuple[str, dict, int]]:
    """Recipe ``r``'s training stages of one drafter: each one's directory (``out``, ``out-stage2``, ..), the
    settings it changes from the first (none for the first), and the number of the recipe's sets it trains on (its
    ``train_sets``, else the recipe's, else all)."""
    out_stages = []
    for i, s in enumerate([{}] + r.get("continue", [])):
        s = dict(s)
        n = s.pop("train_sets", r.get("train_sets")) or len(recipe_sets(r))
        out_stages.append((out if i == 0 else f"{out}-stage{i + 1}", s, n))
    return out_stages


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


def read_json(path: str, tries: int = 5):
    """The JSON file at ``path`` (None if there is none), read again while a running recipe is rewriting it."""
    for i in range(tries):
        if not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                return json.load(f)
        except json.JSONDecodeError:
            if i == tries - 1:
                raise
            time.sleep(0.2)
