"""Shared helpers for the vLLM tests: tiny checkpoints on disk and in-process engines (CPU, eager)."""

import gc
import os
import shutil

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from falcon_vllm.models import model_path  # noqa: E402


def save_target(model, directory: str) -> str:
    """Save a tiny HF model with SmolLM2's tokenizer and chat template (vocab 49152)."""
    model.save_pretrained(directory)
    src = model_path()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), directory)
    return directory


def make_llm(model: str, speculative_config=None, **kw):
    from vllm import LLM

    args = dict(model=str(model), dtype="float32", max_model_len=512, enforce_eager=True, max_num_seqs=8,
                disable_log_stats=False, seed=0)
    args.update(kw)
    return LLM(speculative_config=speculative_config, **args)


def free(llm) -> None:
    """Shut an in-process engine down completely before the next one starts in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def drafter_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter


def spec_counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name.split("vllm:spec_decode_")[1]] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


class EngineCache:
    """Keeps at most one in-process engine alive (they share global state); ``get(name)`` builds
    ``specs[name] = (target dir, speculative config or None, extra LLM kwargs)`` on first use."""

    def __init__(self, specs: dict):
        self.specs, self.name, self.llm = specs, None, None

    def get(self, name):
        if self.name != name:
            self.close()
            target, spec, kw = self.specs[name]
            self.llm = make_llm(target, spec, **kw)
            self.name = name
        return self.llm

    def close(self):
        if self.llm is not None:
            free(self.llm)
            self.llm, self.name = None, None


def greedy(llm, prompts, n=40):
    """Greedy generation of ``n`` tokens (EOS ignored) -> (token lists, request outputs)."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def counter_delta(after: dict, before: dict) -> dict:
    """Difference of two ``spec_counters`` snapshots (per-position lists padded: trees grow them)."""
    return {k: (list(map(lambda a, b: a - b, after[k], before[k] + [0] * (len(after[k]) - len(before[k]))))
                if isinstance(after[k], list) else after[k] - before[k]) for k in after}


# Losslessness on an increment target (``increment_llama``): after token t it puts its mass on t+1+d for
# small d, so every generated increment d = x_i - x_{i-1} - 1 is i.i.d. from one distribution p(d).
def increment_bins(probs, last, vocab: int):
    """p(d) for d = -2..2 plus an 'other' bin, averaged over the rows of ``probs`` (next-token
    distributions after the tokens ``last``)."""
    import torch

    cols = (last[:, None] + 1 + torch.arange(-2, 3)[None]) % vocab             # [R, 5] tokens t+1+d
    p = probs.gather(1, cols).mean(0)
    return torch.cat([p, (1 - p.sum()).clamp(min=0)[None]])


def increment_chi_square(starts, outs, p, vocab: int):
    """(chi-square statistic, observed counts, expected counts) of the increments of generations
    ``outs`` (one per start token) against ``p`` from :func:`increment_bins`; bins with an expected
    count <= 0.5 are left out of the statistic, but a count in a bin of zero probability fails."""
    import torch

    counts = torch.zeros(len(p))
    for s, o in zip(starts, outs):
        seq = [s] + list(o.outputs[0].token_ids)
        for a, b in zip(seq, seq[1:]):
            d = (b - a - 1 + vocab // 2) % vocab - vocab // 2
            counts[d + 2 if -2 <= d <= 2 else -1] += 1
    expected = counts.sum() * p
    impossible = (p <= 0) & (counts > 0)
    assert not bool(impossible.any()), f"observed {counts.tolist()} in bins of zero probability {p.tolist()}"
    keep = expected > 0.5
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum()), counts, expected
