"""The target's hidden states captured inside vLLM's V1 model runner: drafter training data from the engine that
answers (``falcon-vllm gen-data --featurizer vllm``).

:class:`StateCapture` wraps two methods of one runner instance (not its class, so no other engine is touched):
``_prepare_inputs``, to note the step's requests in row order and the tokens each was scheduled, and
``_model_forward``, to keep every computed row's final-norm hidden state (and the residual stream entering each
requested aux layer, vLLM's ``aux_hidden_state_layers``, the same states as transformers' ``hidden_states[i]``)
by request and **position**.  Keyed by position, a prompt whose prefill chunked prefill splits across steps, or
a preempted request computed again, fills the same rows; what prefix caching skips would be a hole, so the
capture engine runs without it and a sequence with a hole is refused.

:class:`CaptureEngine` is the in-process engine around it:

* ``engine(prompts, max_new_tokens)``: greedy answers (the callable ``answer_turns`` takes), whose states are
  kept: every position of prompt + answer but the last sampled token, which is never fed to the model;
* ``engine.featurize(seqs)``: prefill only (each whole sequence as a prompt, one token sampled and dropped):
  every position's state;
* ``engine.take(seq)``: the states captured for a sequence by either, ``[T, W]`` (the last row zero where
  the combined pass never computed it; see :func:`falcon_vllm.train.vllm_data.combined_samples`).

vLLM's own route (``extract_hidden_states`` with ``ExampleHiddenStatesConnector``) does not serve here: the
connector's save path uses CUDA streams and events, it writes one file per request, and its states are the aux
layers only, held in the KV cache.
"""

from __future__ import annotations

import os

import torch


class StateCapture:
    """Rows of the runner's forward passes kept per request: ``(tokens, states, filled)`` buffers indexed by
    position, grown as positions arrive."""

    def __init__(self, runner, aux_layers: tuple[int, ...] = (), dtype: torch.dtype = torch.bfloat16):
        self.runner, self.dtype = runner, dtype
        self.aux_layers = tuple(aux_layers)
        self.store: dict[str, list] = {}  # req id -> [tokens int64, states, filled bool]
        self.step: tuple[list[str], list[int]] | None = None
        self.rows = 0  # rows captured (prefill and decode), for the throughput figures
        if self.aux_layers:
            model = runner.model
            if not hasattr(model, "set_aux_hidden_state_layers"):
                raise ValueError(f"falcon-vllm: {type(model).__name__} cannot return intermediate states "
                                 "(no set_aux_hidden_state_layers): --aux-layers needs an EAGLE-3-capable model")
            model.set_aux_hidden_state_layers(self.aux_layers)
            # vLLM returns them in layer order; the data keeps the order asked for
            self.order = [sorted(set(self.aux_layers)).index(i) for i in self.aux_layers]
        prepare, forward = runner._prepare_inputs, runner._model_forward

        def _prepare_inputs(scheduler_output, num_scheduled_tokens, *a, **k):
            self.step = (list(runner.input_batch.req_ids), [int(n) for n in num_scheduled_tokens])
            return prepare(scheduler_output, num_scheduled_tokens, *a, **k)

        def _model_forward(*a, **k):
            out = forward(*a, **k)
            hidden, aux = out if isinstance(out, tuple) else (out, None)
            if self.step is not None:
                self.keep(k.get("input_ids", a[0] if a else None), k.get("positions", a[1] if len(a) > 1 else None),
                          hidden, aux)
                self.step = None
            return hidden  # the runner was not built for aux outputs: it gets what it expects

        runner._prepare_inputs, runner._model_forward = _prepare_inputs, _model_forward
        self._originals = (prepare, forward)

    def keep(self, input_ids, positions, hidden, aux) -> None:
        req_ids, counts = self.step
        n = sum(counts)
        rows = hidden[:n]
        if self.aux_layers:
            rows = torch.cat([rows] + [aux[j][:n] for j in self.order], -1)
        rows = rows.to(self.dtype)
        pos, ids = positions[:n].long().cpu(), input_ids[:n].long().cpu()
        self.rows += n
        start = 0
        for r, c in zip(req_ids, counts):
            if c:
                self._put(r, pos[start:start + c], ids[start:start + c], rows[start:start + c])
            start += c

    def _put(self, req: str, pos, ids, rows) -> None:
        need = int(pos.max()) + 1
        buf = self.store.get(req)
        if buf is None or buf[0].shape[0] < need:
            cap = max(need, 2 * (buf[0].shape[0] if buf else 0), 256)
            new = [torch.zeros(cap, dtype=torch.long), torch.zeros(cap, rows.shape[1], dtype=self.dtype),
                   torch.zeros(cap, dtype=torch.bool)]
            if buf is not None:
                m = buf[0].shape[0]
                for a, b in zip(new, buf):
                    a[:m] = b
            self.store[req] = buf = new
        buf[0][pos], buf[1][pos], buf[2][pos] = ids, rows, True

    def drain(self) -> dict[tuple, torch.Tensor]:
        """The captured requests (all finished) as {token tuple: states [L, W]}, L its positions computed; the
        store is emptied.  A request with a hole (a position never computed) is refused."""
        out = {}
        for req, (ids, states, filled) in self.store.items():
            n = int(filled.nonzero().max()) + 1 if filled.any() else 0
            if not bool(filled[:n].all()):
                raise RuntimeError(f"falcon-vllm: capture: request {req} has positions never computed (prefix "
                                   "caching on?): its states are incomplete")
            out[tuple(ids[:n].tolist())] = states[:n]
        self.store = {}
        return out

    def remove(self) -> None:
        self.runner._prepare_inputs, self.runner._model_forward = self._originals


def native_bf16() -> bool:
    """Whether this machine computes bf16 natively: a CUDA device, or a CPU with AVX512-BF16 or AMX-BF16."""
    return torch.cuda.is_available() or cpu_bf16()


def cpu_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


def capture_dtype(choice: str = "auto") -> str:
    """``auto``: bfloat16 where the machine has native bf16 (:func:`native_bf16`), float32 elsewhere."""
    if choice == "auto":
        return "bfloat16" if native_bf16() else "float32"
    if choice not in ("float32", "bfloat16"):
        raise ValueError(f"falcon-vllm: the featurizing dtype must be auto, float32 or bfloat16, got {choice!r}")
    return choice


def all_cores_bind() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for one in-process engine on every core this process may use: vLLM's
    ``auto`` keeps one core per rank for an engine-core process that an in-process engine does not have."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cores)


class CaptureEngine:
    """An in-process vLLM engine (prefix caching off, eager) whose forward passes keep the target's states."""

    def __init__(self, target_dir: str, max_model_len: int, max_num_seqs: int = 128, dtype: str = "bfloat16",
                 aux_layers: tuple[int, ...] = (), max_num_batched_tokens: int | None = None, **llm_kwargs):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", all_cores_bind())
        from vllm import LLM

        kw = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
        kw.update(llm_kwargs)
        self.llm = LLM(model=str(target_dir), dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
                       max_num_seqs=max_num_seqs, seed=0, enable_prefix_caching=False, **kw)
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.capture = StateCapture(runner, aux_layers, getattr(torch, dtype))
        self.max_model_len = max_model_len
        self.states: dict[tuple, torch.Tensor] = {}

    def _run(self, prompts, max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        self.states.update(self.capture.drain())
        return [list(o.outputs[0].token_ids) for o in outs]

    def __call__(self, prompts, max_new_tokens: int) -> list[list[int]]:
        """Greedy answers (each up to and including its end-of-turn token), their states kept."""
        return self._run(prompts, max_new_tokens)

    def featurize(self, seqs) -> None:
        """Prefill only: every position's state of each sequence kept (``take``)."""
        self._run(seqs, 1)

    def take(self, seq) -> torch.Tensor | None:
        """``[len(seq), W]`` states of ``seq``: all rows where a prefill computed every position,
        the last row zero where only ``seq[:-1]`` was computed (the answer's last token); None if neither.
        Kept until :meth:`forget` (a conversation may occur twice)."""
        key = tuple(seq)
        if key in self.states:
            return self.states[key]
        got = self.states.get(key[:-1])
        if got is None:
            return None
        return torch.cat([got, got.new_zeros(1, got.shape[1])])

    def forget(self) -> None:
        self.states = {}

    @property
    def rows(self) -> int:
        return self.capture.rows

    def close(self) -> None:
        from falcon_vllm.vllm.engine import shutdown_llm

        self.capture.remove()
        shutdown_llm(self.llm)
        self.llm = None
