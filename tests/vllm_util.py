"""Shared helpers for the vLLM tests: tiny checkpoints on disk and in-process engines (CPU, eager)."""

import os
import shutil

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the exact drafters of the tests need fp32 matmuls (neighbouring tokens of their torus embeddings differ
# below bf16's precision), on every CPU alike; tests of the shipped drafter set auto (the serving default)
os.environ.setdefault("FALCON_VLLM_DRAFT_GEMM_DTYPE", "model")

from falcon_vllm.models import model_path  # noqa: E402
from falcon_vllm.vllm.engine import counter_delta, shutdown_llm, spec_counters  # noqa: E402,F401 (for the tests)


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


def runner_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def drafter_of(llm):
    return runner_of(llm).drafter


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
            shutdown_llm(self.llm)
            self.llm, self.name = None, None


def greedy(llm, prompts, n=40):
    """Greedy generation of ``n`` tokens (EOS ignored) -> (token lists, request outputs)."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


def seeded(llm, prompts, n=12):
    """Seeded random sampling (temperature 0.9, top-p 0.95, seed 100 + prompt index, EOS ignored) -> token lists."""
    from vllm import SamplingParams

    sps = [SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
           for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# Losslessness on a context target (``context_llama``): after a context ending in t the next token is
# t+1+d, d mostly in {-2..2}, with a distribution that depends on the whole context.  Each generated
# token falls in one of 6 bins (d = -2..2, other); under the null hypothesis the count of a bin is a
# sum of independent-given-the-past Bernoulli draws whose expected value is the sum, over the steps,
# of the target's probability of that bin given the actual prefix.
def vllm_probs(logits, temperature: float, top_k: int | None = None, top_p: float | None = None):
    """The distribution vLLM's sampler draws from, [n, V], computed by vLLM's own functions: the logits divided by
    the temperature, top-k / top-p applied by ``apply_top_k_top_p`` (the reference the samplers are checked
    against, rather than the plugin's ``probs_from_logits``)."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    n = logits.shape[0]
    lg = logits.float() / temperature
    k = None if top_k is None else torch.full((n,), top_k, dtype=torch.long)
    p = None if top_p is None else torch.full((n,), top_p, dtype=torch.float32)
    return apply_top_k_top_p(lg, k, p).softmax(-1)


def context_chi_square(model, prompts, outs, temperature, top_k=None, top_p=None):
    """(chi-square statistic, observed counts, expected counts) of generations ``outs`` against the
    HF ``model``'s distributions as vLLM processes them (:func:`vllm_probs`) (temperature, top-k, top-p) along each generated prefix.
    A token of zero probability at its step fails at once; bins with expected count <= 0.5 are left
    out of the statistic (Pearson's statistic with 5 degrees of freedom bounds it: the per-step
    probabilities vary, which only shrinks the variance)."""
    import torch

    V = model.config.vocab_size
    counts, expected = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    for prompt, o in zip(prompts, outs):
        gen = list(o.outputs[0].token_ids)
        seq = list(prompt) + gen
        with torch.no_grad():
            logits = model(torch.tensor([seq[:-1]])).logits[0, len(prompt) - 1:]      # [n, V]: one per token
        probs = vllm_probs(logits, temperature, top_k, top_p).double()
        prev, tok = torch.tensor(seq[len(prompt) - 1:-1]), torch.tensor(gen)
        p_tok = probs.gather(1, tok[:, None]).squeeze(1)
        assert bool((p_tok > 0).all()), f"sampled tokens of zero probability: {tok[p_tok <= 0].tolist()}"
        cols = (prev[:, None] + 1 + torch.arange(-2, 3)[None]) % V                     # tokens t+1+d
        pb = probs.gather(1, cols)
        expected += torch.cat([pb, (1 - pb.sum(1, keepdim=True)).clamp(min=0)], 1).sum(0)
        d = (tok - prev - 1 + V // 2) % V - V // 2
        b = torch.where(d.abs() <= 2, d + 2, torch.full_like(d, 5))
        counts += torch.bincount(b, minlength=6).double()
    keep = expected > 0.5
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum()), counts, expected


def reference_drafts(engine, prompt, n):
    """Generate with the reference engine; return its tokens and each round's drafts (chain or tree nodes)."""
    drafts, draft = [], engine._draft

    def record(*a, **kw):
        out = draft(*a, **kw)
        drafts.append(out.tolist())
        return out

    engine._draft = record
    try:
        return engine.generate(prompt, max_new_tokens=n).tokens, drafts
    finally:
        del engine._draft


def structured(llm):
    """Greedy structured output (a choice, a JSON schema, a regex) beside an unconstrained greedy request (which
    drafts) -> each request's token ids."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams as S

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 8}},
              "required": ["n", "s"]}
    specs = [S(choice=["alpha", "beta", "gamma delta"]), S(json=schema), S(regex=r"[a-z]{3,6}-[0-9]{2,4}")]
    prompts = [[11, 12, 13], list(range(200, 237)), [5] * 9, [7, 8, 7, 8, 7, 8]]
    sps = [SamplingParams(max_tokens=32, temperature=0, structured_outputs=s) for s in specs]
    sps.append(SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
