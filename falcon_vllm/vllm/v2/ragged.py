"""Drafts of different lengths per request on Model Runner V2 (prompt lookup, the datastore, ``draft_confidence``).

V2's speculator returns one tensor of drafts, [requests, K]; the runner keeps it on the device and tells the
scheduler each request's draft width through ``DraftTokensHandler.get_draft_tokens`` (placeholders ``[-1] * K``,
or the tokens themselves where a grammar checks them).  The scheduler schedules as many draft rows per request as
that list is long, and the runner verifies that many (``scheduled_spec_decode_tokens``: per-request counts).  So a
Falcon speculator that drafts ragged records each request's length (``FalconSpeculator.step_lengths``) and the
wrapper here cuts each request's list to it: a request verifies only its own draft, as on the V1 runner, and a
request without a draft verifies nothing but its next token.  The scheduler reads the lists synchronously only
without async scheduling, which ragged drafts need (``options.check_async_scheduling``, at start-up).
"""

from __future__ import annotations

import weakref

HANDLER = "vllm.v1.worker.gpu.spec_decode.utils:DraftTokensHandler"

_speculators: weakref.WeakSet = weakref.WeakSet()  # live Falcon speculators that draft ragged (one per worker)


def install() -> None:
    """Wrap ``DraftTokensHandler.get_draft_tokens`` (idempotent; it changes nothing until a Falcon speculator that
    drafts ragged registers)."""
    from falcon_vllm.vllm import patches

    patches.wrap(patches.resolve(HANDLER), "get_draft_tokens", _get_draft_tokens)


def register(speculator) -> None:
    """Hand ``speculator``'s per-request lengths to the scheduler from now on (only if it drafts ragged)."""
    if getattr(speculator, "ragged", False):
        install()
        _speculators.add(speculator)


def lengths() -> dict[str, int]:
    """The latest step's draft length per request id, over every ragged Falcon speculator of this process."""
    out: dict[str, int] = {}
    for s in list(_speculators):
        out.update(s.step_lengths or {})
    return out


def cut(req_ids: list[str], drafts: list[list[int]], by_req: dict[str, int]) -> list[list[int]]:
    """Each request's draft list cut to its recorded length (requests without one unchanged)."""
    return [d[:by_req[r]] if r in by_req else d for r, d in zip(req_ids, drafts)]


def _get_draft_tokens(orig):
    def get_draft_tokens(self):
        out = orig(self)
        by_req = lengths()
        if out is None or not by_req:
            return out
        out.draft_token_ids = cut(list(out.req_ids), list(out.draft_token_ids), by_req)
        return out

    return get_draft_tokens
