"""Answers for ``falcon-vllm gen-data`` (greedy) and ``gen-prompts`` (sampled) through an in-process vLLM
engine (continuous batching)."""

from __future__ import annotations

import os


class VLLMGenerator:
    """Greedy answers through an in-process vLLM engine (continuous batching), called as
    ``(prompts: list[list[int]], max_new_tokens) -> list[list[int]]`` like :func:`greedy_batch` (each
    answer ends at its first EOS).  ``close()`` shuts the engine down: a live engine's bound CPU threads
    slow the featurizing prefill many times over (``docs/findings.md``), so each shard answers, closes, then featurizes."""

    def __init__(self, target_dir: str, max_model_len: int, max_num_seqs: int = 128, dtype: str = "float32"):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM

        self.llm = LLM(model=str(target_dir), dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
                       max_num_seqs=max_num_seqs, seed=0, enable_prefix_caching=False)

    def __call__(self, prompts, max_new_tokens, temperature: float = 0.0, seeds=None):
        """Greedy continuations, or with ``temperature`` > 0 sampled ones, request i seeded by ``seeds[i]``
        (so a sample does not depend on its batch)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if temperature > 0:
            params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=int(s)) for s in seeds]
        else:
            params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        from falcon_vllm.vllm.engine import shutdown_llm

        shutdown_llm(self.llm)
        self.llm = None
