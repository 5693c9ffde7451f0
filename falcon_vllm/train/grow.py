"""``falcon-vllm gen-data --answers-only FILE``: grow an answers file through vLLM, one shard at a time.

The answers (tokens only, a few MB) are the asset to keep for a large target whose answering takes hours: they are
resumable, fit in the source tree and are featurized later (``gen-data --answers FILE``, here or on another
machine).  With ``--out DIR`` the same pass also keeps the target's states of what it answers (captured inside
vLLM, as ``--featurizer vllm``), in the shards a later ``gen-data --answers FILE --out DIR`` run with the same
``--shard-size`` writes: that run then featurizes only the conversations whose shard is missing, so answering
and featurizing stay one pass while the answers file grows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from falcon_vllm.config import dir_name
from falcon_vllm.train import vllm_data
from falcon_vllm.train.answer_files import GENERATION, answers_meta, load_answers, write_answers
from falcon_vllm.train.gen_checks import check_options, shards_written
from falcon_vllm.train.gen_data import (Job, answer_shard, check_stored_prompts, data_manifest, record_shard,
                                        usable_prompts, write_conversations)


def chunks(start: int, end: int, size: int) -> list[list[int]]:
    """Conversations ``start..end-1`` in shards that begin at multiples of ``size`` (the first may be shorter):
    shard ``i`` of a features directory always holds conversations ``i*size`` onwards."""
    cuts = [start] + [c for c in range((start // size + 1) * size, end, size)] + [end]
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:]) if b > a]


def answers_only(target_dir: str, path: str, num_conversations: int | None, max_new_tokens: int, shard_size: int,
                 data: str | None = None, max_prompt_tokens: int = 384, skip_conversations: int = 0,
                 max_total_tokens: int = 1024, gen_dtype: str = "float32", tokenizer=None,
                 out_dir: str | None = None, featurize_dtype: str = "auto", continues: str | None = None,
                 max_turns: int = 1, loss_from_turn: int = 1) -> int:
    """Answer the prompts through vLLM and grow the answers file ``path`` by one shard at a time.  Resumable: the
    conversations the file holds are kept and the next ones answered.  Each run's conversations, answer tokens
    and seconds are recorded in the file (``runs``).  ``out_dir``: also write the states of every shard answered
    from its first conversation on (vLLM answers in ``featurize_dtype`` then, not ``gen_dtype``).  ``continues``:
    an answers file of the same prompts with fewer turns (``gen-data --answers``): each of its conversations is
    continued to ``max_turns`` turns (the later questions from the data, only the later answers generated, trained
    from turn ``loss_from_turn``); one without a later question is kept as it is (nothing to train on).  Returns
    the conversations the file holds."""
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    check_options(max_turns, loss_from_turn, "target", continues, "vllm")
    tok = tokenizer or AutoTokenizer.from_pretrained(target_dir)
    prompts, convs = usable_prompts(tok, data, num_conversations, skip_conversations, max_prompt_tokens)
    meta = {"target": dir_name(target_dir), "max_new_tokens": max_new_tokens,
            "max_turns": max_turns, "max_total_tokens": max_total_tokens, "max_prompt_tokens": max_prompt_tokens,
            "skip_conversations": skip_conversations, "loss_from_turn": loss_from_turn,
            "generation": GENERATION["target"],
            "data": dir_name(data) if data else "sharegpt"}  # the prompts' file, named when --answers mismatches
    first, first_turns = earlier_turns(continues, meta, prompts) if continues else ([], 1)
    stored = load_answers(path, meta)[0] if os.path.exists(path) else []
    runs = json.loads(answers_meta(path).get("runs", "[]")) if stored else []
    check_stored_prompts(((i, q) for i, (q, _) in enumerate(stored[:len(prompts)])), prompts, path, path)
    manifest = None
    if out_dir:
        gen_dtype = vllm_data.featurize_dtype(featurize_dtype)
        manifest = data_manifest(target_dir, AutoConfig.from_pretrained(target_dir).hidden_size, max_new_tokens,
                                 max_turns, max_total_tokens, max_prompt_tokens, skip_conversations, "vllm",
                                 loss_from_turn, (), "target", "vllm", gen_dtype, shard_size)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        manifest["shards"] = shards_written(out_dir, manifest)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    job = Job(target_dir, None, tok, pad, {tok.eos_token_id} - {None}, backend="vllm", replies="target",
              batch_size=shard_size, max_new_tokens=max_new_tokens, max_turns=max_turns,
              max_total_tokens=max_total_tokens, loss_from_turn=loss_from_turn, aux_layers=(), answers=continues,
              stored=first, stored_turns=first_turns, keep_engine=True,
              gen_dtype=gen_dtype, featurizer="vllm" if out_dir else "hf")
    run_log = {"dtype": gen_dtype, "shard_size": shard_size, "conversations": 0, "answer_tokens": 0, "seconds": 0.0}
    runs.append(run_log)
    bar = tqdm(total=len(prompts), initial=min(len(stored), len(prompts)), desc="gen-data (answers only)", unit="conv")
    try:
        for shard in chunks(len(stored), len(prompts), shard_size):
            if manifest is not None and shard[0] % shard_size == 0:  # the whole shard's states, kept while answering
                name = f"shard_{shard[0] // shard_size:05d}.safetensors"
                entry, seqs, masks = write_conversations(job, Path(out_dir, name), shard, prompts, convs)
                record_shard(Path(out_dir), manifest, entry)
                secs = entry["generate_s"]
            else:  # part of a shard: no states kept
                seqs, masks, secs = answer_shard(job, shard, prompts, convs, bool(first))
                if manifest is not None:
                    job.generate.forget()
            stored += list(zip(seqs, masks))
            run_log["conversations"] += len(shard)
            run_log["answer_tokens"] += sum(sum(m) for m in masks)
            run_log["seconds"] = round(run_log["seconds"] + secs, 1)
            offsets = [0]
            for q, _ in stored:
                offsets.append(offsets[-1] + len(q))
            write_answers(path, [t for q, _ in stored for t in q], [x for _, m in stored for x in m], offsets,
                          {**meta, "runs": json.dumps(runs)})
            bar.update(len(shard))
            bar.set_postfix(answer_tok_s=f"{run_log['answer_tokens'] / max(run_log['seconds'], 1e-9):.1f}")
    finally:
        bar.close()
        if job.generate is not None:
            job.generate.close()
    return len(stored)


def earlier_turns(continues: str, meta: dict, prompts: list) -> tuple[list, int]:
    """The conversations of the answers file ``continues`` that an answers-only run of ``meta``'s settings continues
    to more turns, and the turns they hold: the file must have fewer turns, the same other settings, and a
    conversation for each of ``prompts`` that begins with it."""
    first, turns = load_answers(continues, meta)
    if turns >= int(meta["max_turns"]):
        raise ValueError(f"falcon-vllm: gen-data: --answers {continues} holds {turns}-turn conversations: nothing to "
                         f"continue to --max-turns {meta['max_turns']}")
    if len(first) < len(prompts):
        raise ValueError(f"falcon-vllm: gen-data: --answers {continues} holds {len(first)} conversations, fewer than "
                         f"the {len(prompts)} to continue (answer their first turns into it first)")
    check_stored_prompts(((i, q) for i, (q, _) in enumerate(first[:len(prompts)])), prompts,
                         f"--answers {continues}", continues)
    return first, turns
