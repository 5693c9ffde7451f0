"""gen-data's features from inside vLLM (``--featurizer vllm``): the target's states kept while vLLM answers, so
answering and featurizing are one pass; stored answers (``--answers``) and the data's replies featurized by a
prefill-only pass through the same engine.  The engine is :class:`falcon_vllm.vllm.capture.CaptureEngine`
(imported only when a run asks for it: this module imports without vLLM).

What differs from the transformers path (``--featurizer hf``, an fp32 prefill after answering):

* the states are computed in ``--featurize-dtype`` (``auto``: bf16 where the machine computes bf16 natively,
  fp32 elsewhere), and vLLM answers in that dtype too; the manifest records both;
* in the combined pass the answer's last token is never fed to the model, so its row is zero.  Nothing reads
  that row: the trainer, the evaluation and ``tune-tree`` read the features of a position only to predict a
  later token (``make_batch``: rows up to T-2).  Conversations answered in a turn that a later turn did not
  continue (or stored answers) go through the prefill pass and have every row.
"""

from __future__ import annotations

import time

import torch

LAST_ROW = "zero where the combined pass never computed it (the answer's last token; read by nothing)"


def featurize_dtype(choice: str) -> str:
    """The dtype of the states: ``auto`` is bfloat16 on machines with native bf16, float32 elsewhere."""
    from falcon_vllm.vllm.capture import capture_dtype  # imports no vLLM at module level

    return capture_dtype(choice)


def capture_engine(target_dir: str, max_model_len: int, max_num_seqs: int, dtype: str, aux_layers: tuple[int, ...]):
    """The in-process engine that answers and keeps the target's states (one per run: kept up across shards)."""
    from falcon_vllm.vllm.capture import CaptureEngine  # only falcon_vllm.vllm imports vllm

    return CaptureEngine(target_dir, max_model_len, max_num_seqs=max_num_seqs, dtype=dtype, aux_layers=aux_layers)


def capture_features(engine, seqs: list[list[int]], combined: bool, max_tokens: int = 16384):
    """``[T, W]`` bf16 features per sequence: from the combined pass where ``combined`` and the engine answered
    the sequence (its last row zero), the rest from prefill-only passes of at most ``max_tokens`` tokens each.
    Returns (features, conversations whose last row is zero, prefill seconds)."""
    got = [engine.take(s) if combined else None for s in seqs]
    zero_last = sum(1 for s, g in zip(seqs, got) if g is not None and tuple(s) not in engine.states)
    todo = [i for i, g in enumerate(got) if g is None]
    t0 = time.time()
    batch: list[int] = []
    for n, i in enumerate(todo):
        batch.append(i)
        if n + 1 == len(todo) or sum(len(seqs[j]) for j in batch) + len(seqs[todo[n + 1]]) > max_tokens:
            engine.featurize([seqs[j] for j in batch])
            for j in batch:
                got[j] = engine.take(seqs[j])
            batch = []
    missing = [i for i, g in enumerate(got) if g is None]
    if missing:
        raise RuntimeError(f"falcon-vllm: gen-data: no states were captured for conversations {missing}")
    engine.forget()
    return [g.to(torch.bfloat16) for g in got], zero_last, time.time() - t0


def add_arguments(p) -> None:
    p.add_argument("--featurizer", choices=["hf", "vllm"], default="hf",
                   help="where the hidden states come from: hf, a transformers fp32 prefill after answering; vllm, "
                        "kept while vLLM answers (one pass), stored answers by a prefill through vLLM")
    p.add_argument("--featurize-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="--featurizer vllm: the dtype the target answers and computes its states in (auto: bf16 "
                        "where the machine has native bf16, AVX512-BF16 / AMX / a GPU, fp32 elsewhere)")
