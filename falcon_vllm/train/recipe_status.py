"""``falcon-vllm train --recipe NAME --work DIR --status``: where a recipe's run stands, read from its files alone.

Each set's conversations featurized (and those still to answer) with the hours left at the rate of the last
prefilled shards, the teacher caches, each training stage's epoch and step from its checkpoint with the hours left
at the rate of its timed steps, the fitted trees, and what the same command resumes next.  It runs nothing.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch

from falcon_vllm.train.answer_files import answers_meta
from falcon_vllm.train.data import TEACHER_CACHE
from falcon_vllm.train.recipes import (ANSWERS, RECIPES, began_with, held, read_json, read_pins, recipe_sets,
                                       run_stages, set_dir)


def recipe_status(name: str, work: str, num_sets: int | None = None) -> list[str]:
    """Lines that say where the recipe ``name``'s run in ``work`` stands, stage by stage, and which stage is next
    (``num_sets``: ``--sets``, for a run not yet begun)."""
    r = RECIPES[name]
    lines, todo = [f"recipe {name} in {work}"], []
    pins = read_pins(work)
    sets = began_with(r, work, pins, num_sets)
    if added := [s["name"] for s in recipe_sets(r) if s not in sets]:
        lines.append(f"sets {', '.join(added)}: not in this run (it began without them; a new --work trains on them)")
    counts, prefills, left_convs, per_conv = [], [], 0, []
    for s in sets:
        d = set_dir(work, s)
        n = s.get("num_conversations") or pins["counts"].get(s["name"])
        stored = held(os.path.join(ANSWERS, s["answers"]))
        growing = n is None
        if growing:  # its count is fixed when the run first starts: what its answers file holds now
            n = stored
        shards = written_shards(d)
        have = sum(sh["conversations"] for sh in shards)
        # what is left is a prefill of stored answers: its rate, from the shards written so (by when written)
        prefills += [(os.path.getmtime(os.path.join(d, sh["file"])), sh["tokens"], sh.get("featurize_s", 0))
                     for sh in shards if sh.get("from_answers")]
        per_conv += [sh["tokens"] / sh["conversations"] for sh in shards if sh["conversations"]]
        counts.append(n)
        left_convs += max(min(n, stored) - have, 0)  # a prefill of stored answers (those to answer: while answered)
        lines.append(f"data {s['name'] or '.'}: {have} of {n} conversations featurized "
                     f"({len(shards)} of {math.ceil(n / r['shard_size'])} shards)"
                     + (" (all its answers file holds now; fixed when the run starts)" if growing else "")
                     + (f" ({n - stored} to {'continue' if s.get('continues') else 'answer'} first: {s['answers']} "
                        f"holds {stored})" if stored < n else ""))
        if have < n:
            todo.append("data")
    if left_convs and per_conv and sum(p[2] for p in prefills):
        def rate(part):
            return sum(p[1] for p in part) / sum(p[2] for p in part)

        recent = sorted(prefills)[-4:]  # the CPU's rate now (a shard that ran beside other work was slower)
        hours = left_convs * sum(per_conv) / len(per_conv) / rate(recent) / 3600
        lines.append(f"data: about {hours:.1f} h left at {rate(recent):.0f} tokens/s (the last {len(recent)} "
                     f"prefilled shards; {rate(prefills):.0f} over all {len(prefills)})")
    lines += answering_lines(work, sets, counts) + teacher_lines(work, sets, counts)
    for drafter, label in (("falcon", "Falcon"), ("eagle", "EAGLE-1")):
        for d, stage, _ in run_stages(r, os.path.join(work, drafter), len(sets)):
            line, done = stage_line(d, stage.get("epochs", r.get(f"{drafter}_epochs", r["epochs"])))
            lines.append(f"{label} {os.path.basename(d)}: {line}")
            if not done:
                todo.append(os.path.basename(d))
        if drafter == "falcon" and "tune_tree" in r:
            fitted = os.path.exists(os.path.join(d, "serving.json"))
            lines.append(f"trees {os.path.basename(d)}/serving.json: {'fitted' if fitted else 'not yet'}")
            if not fitted:
                todo.append("tune-tree")
    log = read_json(os.path.join(work, "recipe_log.json"))
    if todo and log is not None and not log.get("baseline", True) and all(t.startswith("eagle") for t in todo):
        lines.append("finished without the EAGLE-1 baseline (--no-baseline; the same command without it trains the "
                     "baseline)")
    elif todo:
        lines.append(f"next: {todo[0]} (run the same train --recipe command to resume)")
    elif log is not None:
        lines.append("finished (recipe_log.json)")
    else:
        lines.append("next: the last steps (run the same train --recipe command to finish)")
    return lines


def answering_lines(work: str, sets: list, counts: list) -> list[str]:
    """The answering still to do (sets whose answers files hold fewer conversations than their counts), with the
    hours left at the rate of the last four shards answered into those sets' directories (the CPU's rate now), else
    of the latest run that grew such a file (its answer tokens per conversation and per second); the sets of later
    turns apart, at their own rate (each prefills a first turn before it answers, and some have no later question)."""
    out = []
    for turns in sorted({s.get("max_turns", 1) for s in sets}):
        kind = [(s, n) for s, n in zip(sets, counts) if s.get("max_turns", 1) == turns]
        out += answering_line(work, kind, "answering" + (f" (turn {turns})" if turns > 1 else ""))
    return out


def answering_line(work: str, sets: list, label: str) -> list[str]:
    """``answering_lines`` of ``sets`` ((set, count) pairs of one kind)."""
    left, last, shards = 0, None, []
    for s, n in sets:
        path, d = os.path.join(ANSWERS, s["answers"]), set_dir(work, s)
        if n <= (stored := held(path)):
            continue
        left += n - stored
        runs = [x for x in json.loads(answers_meta(path).get("runs", "[]")) if x.get("seconds")] \
            if os.path.exists(path) else []
        last = runs[-1] if runs else last
        shards += [(os.path.getmtime(os.path.join(d, sh["file"])), sh["answer_tokens"], sh["generate_s"],
                    sh["conversations"]) for sh in written_shards(d) if sh.get("generate_s") and "answer_tokens" in sh]
    if not left:
        return []
    if shards:
        recent = sorted(shards)[-4:]
        tokens, seconds, convs = (sum(x[i] for x in recent) for i in (1, 2, 3))
        how = f"the last {len(recent)} shards answered"
    elif last is not None:
        tokens, seconds, convs = last["answer_tokens"], last["seconds"], last["conversations"]
        how = f"{last['dtype']}, the last run that answered"
    else:  # a later turn's set counts every conversation it continues; only those with a later question are answered
        later = any(s.get("continues") for s, _ in sets)
        verb = "continue (those with a later question answered)" if later else "answer"
        return [f"{label}: {left} conversations to {verb} (no rate measured yet)"]
    rate, per_conv = tokens / seconds, tokens / convs
    return [f"{label}: about {left * per_conv / rate / 3600:.1f} h left for {left} conversations at {rate:.1f} "
            f"answer tokens/s ({per_conv:.0f} a conversation; {how})"]


def written_shards(d: str) -> list[dict]:
    """The manifest entries of the shards a gen-data directory holds (those whose file exists)."""
    shards = (read_json(os.path.join(d, "manifest.json")) or {}).get("shards", [])
    return [sh for sh in shards if os.path.exists(os.path.join(d, sh["file"]))]


def teacher_lines(work: str, sets: list, counts: list) -> list[str]:
    """The teacher caches: one next to the first set (its conversations), one next to the second for the others."""
    out = []
    for label, s, want in [("first set", sets[0], counts[0])] + ([("other sets", sets[1], sum(counts[1:]))]
                                                                  if len(sets) > 1 else []):
        d = set_dir(work, s)
        found = [(int(m[1]), bool(m[2])) for f in (os.listdir(d) if os.path.isdir(d) else [])
                 if (m := TEACHER_CACHE.match(f))]
        partial = [m for m, p in found if p or m < want]  # an interrupted build, or a run's of fewer sets
        state = ("built" if (want, False) in found else f"{max(partial)} conversations so far (partial)" if partial
                 else "not yet")
        out.append(f"teacher cache ({label}, {want} conversations): {state}")
    return out


def stage_line(d: str, epochs: int) -> tuple[str, bool]:
    """One training stage's state (trained, at a checkpoint's epoch and step, or not started) and whether it is done."""
    if os.path.exists(os.path.join(d, "model.safetensors")):
        return "trained", True
    ck = os.path.join(d, "checkpoint.pt")
    if not os.path.exists(ck):
        return f"not started ({epochs} epochs)", False
    c = torch.load(ck, map_location="cpu", weights_only=False, mmap=True)
    st, total, timed = c["state"], c.get("total"), c.get("timed_steps")
    age = (time.time() - os.path.getmtime(ck)) / 60
    left = ""
    if total and timed:  # checkpoints written before the trainer timed its steps say nothing of the time left
        rate = c["seconds"] / timed
        left = f"; about {(total - st['step']) * rate / 3600:.1f} h left at {rate:.1f} s a step"
    return (f"epoch {st['epoch']} of {epochs} done, step {st['step']}{f' of {total}' if total else ''} "
            f"(checkpoint.pt written {age:.0f} min ago{left})"), False


