"""Prompt lookup first, Falcon otherwise (chain mode, ``prompt_lookup_max`` in the speculative config).

Each step, for each request, an n-gram matcher (:func:`ngram_draft`, which proposes what vLLM 0.32's
``method: "ngram"`` proposes) looks for the longest suffix of the request's tokens, between ``prompt_lookup_min`` and
``prompt_lookup_max`` tokens long, that occurred earlier in its prompt or output, and proposes up to
``num_speculative_tokens`` tokens that followed it.  A request with a match gets those drafts; a request
without one gets the Falcon drafter's chain of ``falcon_tokens`` tokens.  The two are complementary:
a lookup draft is free and long but exists only where text repeats (code, quotations, a model's own
loops); the drafter drafts everywhere, a few tokens at a time.

``lookup_tokens`` below K makes a request's lookup length adaptive: it starts at ``lookup_tokens``,
doubles (up to K) after each of its lookup drafts that the target accepted whole, and falls back to
``lookup_tokens`` after one that it cut short.  Long drafts then go where the text is being copied
(a repeated function body, a quoted passage), short ones elsewhere: every verified row costs target
arithmetic, and a rejected lookup row buys nothing.

Verification is unchanged (vLLM's rejection sampler on one-hot proposals), so outputs are exactly
vanilla vLLM's whatever is drafted.  Drafts become per-request lists of different lengths, as vLLM's
ngram method returns them; that needs vLLM's synchronous scheduler (the CPU platform always runs it; elsewhere
the config hook turns async scheduling off, and refuses an explicit request for it: ``options.check_async_scheduling``).

With a datastore (``datastore``: :mod:`falcon_vllm.datastore`), a request whose own tokens repeat nothing is
looked up in the target's stored answers next; the drafter's chain covers what neither finds.

A step with drafting off (``num_speculative_tokens_per_batch_size`` gives 0 at that batch size) runs no drafter
pass, so it writes no drafter K/V.  On CPU it keeps each request's verified rows instead (the drafter's inputs,
at most ``gap_rows`` per request: ``FalconProposer.keep_gap_rows``), and when the batch shrinks and drafting
resumes, the first drafter pass runs them before its own rows: the request's drafter K/V is whole, and it drafts as
if drafting had never stopped.  A request whose rows could not be kept (past ``gap_rows``, or where no fused pass
runs) has a gap in the drafter's KV cache: it gets lookup drafts only, never the drafter's chain, which would
attend over the gap, and a step where every request has one runs no drafter pass (``LookupState.gapped``, :mod:`~falcon_vllm.core.plan`)
(what the gap cost before the rows were kept: ``docs/findings.md``).  A step of more than ``falcon_max_batch`` requests is served the same
way with lookup drafts on: each request gets its lookup draft or nothing, no drafter pass runs, and the rows are kept.

The drafter's own KV cache must still cover every verified token.  When every request of a step has a lookup
draft, on CPU no drafter pass runs: the step's verified rows wait and the next drafter pass runs them first
(``FalconProposer.defer_chunk``); elsewhere the chunk pass runs and only the drafting passes are skipped.
"""

from __future__ import annotations

import numpy as np
import torch

from falcon_vllm.core.plan import StepPlan
from falcon_vllm.datastore import Datastore


def lookup_drafts(token_ids_cpu: np.ndarray, num_tokens: np.ndarray, sampled: np.ndarray | None, use: np.ndarray,
                  min_n: int, max_n: int, k, max_model_len: int, store: Datastore | None = None,
                  store_tokens: int | None = None) -> list[list[int]]:
    """Per request i (``use[i]``): the lookup draft after its history (at most ``k`` tokens, or ``k[i]``), else [].

    The history of request i is ``token_ids_cpu[i, :num_tokens[i]]`` followed by this step's sampled
    tokens ``sampled[i]`` that are not placeholders (< 0); ``sampled`` None: the history already holds them.
    With a ``store``, a request whose history repeats nothing gets the datastore's draft instead, if any (at most
    ``store_tokens`` tokens when given).
    """
    out = []
    for i in range(len(use)):
        if not use[i]:
            out.append([])
            continue
        hist = token_ids_cpu[i, :num_tokens[i]]
        if sampled is not None:
            new = sampled[i][sampled[i] >= 0]
            hist = np.concatenate([hist, new.astype(token_ids_cpu.dtype)])
        n = int(k if np.isscalar(k) else k[i])
        draft = ngram_draft(hist, min_n, max_n, max_model_len, n).tolist()
        if not draft and store is not None:
            draft = store.draft(hist, min(n, store_tokens or n, max_model_len - len(hist)))
        out.append(draft)
    return out


def ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, max_model_len: int, k: int) -> np.ndarray:
    """The tokens that followed the longest earlier occurrence of a suffix of ``tokens`` (an n-gram of ``min_n`` ..
    ``max_n`` tokens; of several occurrences, the first), at most ``k`` and never past ``max_model_len``: the
    draft of vLLM's n-gram method (``method: "ngram"``; its matcher left vLLM in 0.34), written here for every
    vLLM.  Empty when no suffix repeats."""
    T = tokens.shape[0]
    k = min(k, max_model_len - T)
    if T < min_n or k <= 0 or T < 2:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:T - 1] == tokens[T - 1])  # earlier occurrences of the last token (match ends)
    if ends.size == 0:
        return tokens[:0]
    length = np.ones(ends.size, dtype=np.int64)  # how far each match reaches back, up to max_n
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_n, T - 1)):
        prev = ends - back
        alive &= (prev >= 0) & (tokens[np.maximum(prev, 0)] == tokens[T - 1 - back])
        if not alive.any():
            break
        length += alive
    longest = int(length.max())
    if longest < min_n:
        return tokens[:0]
    start = int(ends[np.argmax(length == longest)]) + 1  # the first occurrence of the longest match
    return tokens[start:start + min(k, T - start)]


def warm_up() -> None:
    """Run the matcher once before the first request."""
    lookup_drafts(np.arange(8, dtype=np.int32)[None].repeat(2, 0) % 3, np.array([8, 8]),
                  np.array([[1], [-1]]), np.array([True, True]), 2, 3, 2, 64)


class LookupState:
    """Prompt lookup's state across steps: the settings, the gapped requests, the adaptive lengths, the counters
    (each step's decision is a :class:`~falcon_vllm.core.plan.StepPlan`)."""

    def __init__(self, min_n: int, max_n: int, falcon_tokens: int, lookup_tokens: int | None = None,
                 store: Datastore | None = None, store_tokens: int | None = None, store_max_batch: int | None = None,
                 falcon_max_batch: int | None = None):
        self.min_n, self.max_n, self.falcon_tokens = min_n, max_n, falcon_tokens
        self.store = store  # the target's stored answers, where the request's own tokens repeat nothing
        self.store_tokens = store_tokens  # the longest datastore draft (None: as long as a lookup draft)
        self.store_max_batch = store_max_batch  # the store is looked up in steps of at most this many requests
        self.lookup_tokens = lookup_tokens  # None: every lookup draft up to the step's budget
        self.falcon_max_batch = falcon_max_batch  # the drafter's chain only in steps of at most this many requests
        self.lookup_drafts = 0   # requests x steps served by a lookup draft
        self.falcon_drafts = 0   # requests x steps served by the drafter
        self.gapped: set[str] = set()  # running requests whose drafter K/V has a gap: no drafter chain
        self.gap_from: dict[str, int] = {}  # a gapped request's first position whose rows may reach no drafter pass
        # adaptive lengths: request id -> (history length at its last step, that step's lookup draft length,
        # the lookup length it was given); requests absent from a step are forgotten
        self._runs: dict[str, tuple[int, int, int]] = {}

    def skipped(self, req_ids, alive=None) -> None:
        """A step ran with drafting off and kept none of these requests' rows: their drafter KV now has a gap.
        ``alive``: the runner's live requests (scheduled or not, ``runner.requests``), to forget the finished ones
        and to read where each gap starts."""
        self.gap(req_ids, alive)
        if alive is not None:
            self.prune(alive)

    def gap(self, req_ids, requests=None) -> None:
        """Mark requests gapped from this step's rows on (``requests``: the runner's, for their computed tokens)."""
        for r in req_ids:
            self.gapped.add(r)
            state = None if requests is None or not hasattr(requests, "get") else requests.get(r)
            self.gap_from.setdefault(r, int(getattr(state, "num_computed_tokens", 0) or 0))

    def prune(self, alive) -> None:
        """Forget the gaps of finished requests (``alive``: every request the runner still holds, scheduled this
        step or not: a request left out of one step keeps its gap)."""
        self.gapped.intersection_update(alive)
        for r in set(self.gap_from).difference(self.gapped):
            del self.gap_from[r]

    def draft(self, req_ids: list[str], token_ids: np.ndarray, num_tokens: np.ndarray, sampled: np.ndarray | None,
              use: np.ndarray, k: int, max_model_len: int) -> list[list[int]]:
        """The lookup drafts of one step (:func:`lookup_drafts`' arguments, ``req_ids`` naming the rows), at each
        request's adaptive length when ``lookup_tokens`` is set (remembered for the next step)."""
        lengths = k
        if self.lookup_tokens is not None:  # also at a budget k <= lookup_tokens: the record stays current
            hist = num_tokens + (0 if sampled is None else (sampled >= 0).sum(1))
            lengths = self._lengths(req_ids, hist, k)
        store = self.store if self.store_max_batch is None or len(req_ids) <= self.store_max_batch else None
        drafts = lookup_drafts(token_ids, num_tokens, sampled, use, self.min_n, self.max_n, lengths, max_model_len,
                               store, self.store_tokens)
        if self.lookup_tokens is not None:
            self._runs = {r: (int(n), len(d), L) for r, n, d, L in zip(req_ids, hist, drafts, lengths)}
        return drafts

    def _lengths(self, req_ids: list[str], hist: np.ndarray, k: int) -> list[int]:
        """Each request's lookup length this step: doubled (up to ``k``) after a lookup draft accepted whole
        (its history grew by the draft plus the bonus token), back to ``lookup_tokens`` after one cut short,
        unchanged after a drafter step."""
        out = []
        for r, n in zip(req_ids, hist):
            n0, d, L = self._runs.get(r, (0, 0, self.lookup_tokens))
            if d:
                L = max(2 * L, self.lookup_tokens) if n - n0 == d + 1 else self.lookup_tokens
            out.append(max(1, min(L, k)))
        return out

    def count(self, plan: StepPlan) -> None:
        """Count a planned step's requests served by a lookup draft and by the drafter's chain."""
        self.lookup_drafts += sum(1 for d in plan.lookup if d)
        self.falcon_drafts += sum(1 for d, w in zip(plan.lookup, plan.withheld) if not d and not w)

    def merge(self, plan: StepPlan, falcon: torch.Tensor | list[list[int]],
              probs: torch.Tensor | None = None) -> tuple[list[list[int]], torch.Tensor | None]:
        """The step's drafts: each request's lookup draft (``plan.lookup``), or the drafter's chain (``falcon``
        [B, <=K], or per-request lists: chains cut by ``draft_confidence``), nothing for a withheld request.

        Returns (drafts, probs).  ``probs``: the chain's draft distributions [B, <=K, V] (draft_sample_method
        "probabilistic"), returned merged, [B, longest draft, V], a lookup draft's rows one-hot at its tokens (a
        point-mass proposal, as vLLM verifies drafts that come without probabilities); None stays None."""
        rows = falcon if isinstance(falcon, list) else falcon.tolist()
        drafts, withheld = plan.lookup, plan.withheld
        out = [d if d else [] if withheld[i] else rows[i] for i, d in enumerate(drafts)]
        n = sum(1 for d in drafts if d)
        self.count(plan)
        if probs is not None and n:
            width = max(len(d) for d in out)  # may be below the chain's K: every draft shorter (a gap, short lookups)
            merged = probs.new_zeros(probs.shape[0], width, probs.shape[2])
            w = min(width, probs.shape[1])
            merged[:, :w] = probs[:, :w]
            for i, d in enumerate(drafts):
                if d:
                    merged[i] = 0.0
                    merged[i, torch.arange(len(d), device=probs.device), torch.tensor(d, device=probs.device)] = 1.0
            probs = merged
        return out, probs
