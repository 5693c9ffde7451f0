"""The target's verify cost measured inside vLLM, for ``falcon-vllm tune-tree`` (``--cost vllm``).

Verifying a tree of W - 1 nodes at batch size B is one target step over B x W new tokens that follow each
request's cached context.  vLLM runs exactly such a step when a request's prompt is a cached prefix plus W new
tokens: prefix caching skips the prefix and the step computes the W tokens over it.  So for each (B, W) the
engine is given B requests of ``prefix`` cached tokens plus W fresh ones, one output token each, and the time
of the model runner's step (``execute_model`` and ``sample_tokens``, where the runner splits them) is taken,
the best of ``repeats``.  A prefill step computes logits on its last row only, where verification needs all W
rows: the LM head's time on the B x (W - 1) other rows, timed on the same loaded model, is added.  W = 1 is a
decode step's cost, the baseline every tree is compared to.
"""

from __future__ import annotations

import os
import time


def _timed(runner, spent: list) -> dict:
    """Wrap the runner's step methods so that their wall time is added to ``spent[0]``, the tokens its steps
    computed to ``spent[1]`` and the steps that computed any to ``spent[2]``; returns the originals, to put
    back."""
    originals = {}
    for name in ("execute_model", "sample_tokens"):
        orig = getattr(runner, name, None)
        if orig is None:
            continue

        def timed(*a, _orig=orig, _name=name, **kw):
            if _name == "execute_model":
                n = getattr(a[0] if a else kw.get("scheduler_output"), "total_num_scheduled_tokens", 0)
                spent[1] += n
                spent[2] += n > 0
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0

        originals[name] = orig
        setattr(runner, name, timed)
    return originals


def measure(target: str, batch_sizes, widths, prefix: int = 256, repeats: int = 3, compile: bool = False,
            progress=None) -> dict:
    """{(B, W): seconds of one verify step} for every B in ``batch_sizes`` and W in ``widths`` (1 included
    always: the decode step), on the target directory ``target`` served by an in-process vLLM engine."""
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # CPU: a fixed KV cache (the steps timed need a few hundred tokens), not 92% of the machine's memory, which
    # vLLM refuses to start without when another model (the tune-tree target, a recipe's) is already loaded
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from falcon_vllm.vllm.engine import shutdown_llm

    batch_sizes, widths = sorted(set(batch_sizes)), sorted(set(widths) | {1})
    max_b, max_w = max(batch_sizes), max(widths)
    room = -(-prefix // 128) * 128 + max_w + 64  # the prefix in whole blocks (CPU: 128 tokens), then W tokens
    llm = LLM(model=str(target), dtype="float32", max_model_len=room, enforce_eager=not compile,
              max_num_seqs=max_b, max_num_batched_tokens=max(max_b * max_w, room), seed=0, enable_prefix_caching=True)
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        block = llm.llm_engine.vllm_config.cache_config.block_size
        prefix = -(-prefix // block) * block  # whole blocks: only those are cached
        if prefix + max_w > room:
            raise ValueError(f"falcon-vllm: tune-tree: a prefix of {prefix} tokens in blocks of {block} and "
                             f"{max_w} more do not fit the {room} tokens the engine was made for")
        vocab = runner.model_config.get_vocab_size()
        gen = torch.Generator().manual_seed(0)

        def ids(n):
            return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()

        one = SamplingParams(temperature=0.0, max_tokens=1)
        spent = [0.0, 0, 0]  # seconds, tokens computed, steps
        originals = _timed(runner, spent)
        costs = {}
        try:
            for B in batch_sizes:
                heads = [ids(prefix) for _ in range(B)]
                llm.generate([{"prompt_token_ids": h} for h in heads], one, use_tqdm=False)  # cache the prefixes
                for W in widths:
                    best = float("inf")
                    for _ in range(repeats + 1):  # the first run of a shape warms up
                        spent[:] = [0.0, 0, 0]
                        llm.generate([{"prompt_token_ids": h + ids(W)} for h in heads], one, use_tqdm=False)
                        if spent[1:] != [B * W, 1]:
                            raise RuntimeError(f"falcon-vllm: tune-tree: the timed vLLM steps ({spent[2]}) computed "
                                               f"{spent[1]} tokens, not one step of {B} x {W}: the prefix cache "
                                               "missed (give the engine more KV cache: VLLM_CPU_KVCACHE_SPACE)")
                        best = min(best, spent[0])
                    costs[(B, W)] = best + _extra_head_rows(runner, B * (W - 1), repeats)
                    if progress is not None:
                        progress.update(1)
        finally:
            for name, orig in originals.items():
                setattr(runner, name, orig)
        return costs
    finally:
        shutdown_llm(llm)


def _extra_head_rows(runner, rows: int, repeats: int) -> float:
    """Seconds of the target's LM head on ``rows`` more rows (0 for none), on the loaded model."""
    import torch

    if rows <= 0:
        return 0.0
    hidden = torch.randn(rows, runner.model_config.get_hidden_size(), dtype=runner.dtype, device=runner.device)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            runner.model.compute_logits(hidden)
            best = min(best, time.perf_counter() - t0)
    return best
