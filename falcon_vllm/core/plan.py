"""One step's drafting decision, made in one place for both model runners.

Before any drafter pass, a step is planned from its draft budget ``K`` (vLLM's ``num_speculative_tokens`` for
this step: 0 where the per-batch-size schedule or the scheduler turned drafting off), its requests and, with prompt
lookup on, each request's lookup draft.  The plan says what the drafter does:

* ``K == 0``: no drafts; the step's verified rows wait for the next drafter pass (the runner keeps them).
* every request served without the drafter's chain (each has a lookup draft, has a gap in its drafter K/V, or the
  step is past ``falcon_max_batch``): ``chain == 0``, no drafting pass; the rows wait for the next one.
* otherwise the drafter's chain (or tree) of ``chain`` tokens, each request's lookup draft replacing its chain.

The V1 runner's hook (:mod:`falcon_vllm.vllm.hooks`) and Model Runner V2's speculator
(:class:`falcon_vllm.vllm.v2.speculator.FalconSpeculator`) call :func:`plan_step` and carry out its plan, each
in its runner's terms.
"""

from __future__ import annotations

from typing import NamedTuple


class StepPlan(NamedTuple):
    """What one step drafts, decided before any drafter pass."""

    K: int                            # the step's draft budget (0: drafting off)
    lookup: list[list[int]] | None    # each request's prompt-lookup draft ([]: none); None without prompt lookup
    withheld: list[bool] | None       # the requests the drafter's chain does not serve (a K/V gap; lookup_only)
    chain: int                        # the drafter chain's length (0: no drafting pass this step)
    lookup_only: bool = False         # past falcon_max_batch: lookup drafts alone, the drafter's rows kept

    @property
    def all_withheld(self) -> bool:
        """No request gets the drafter's chain: it has a gap, or the step is past ``falcon_max_batch``."""
        return bool(self.withheld) and all(self.withheld)

    @property
    def all_matched(self) -> bool:
        """Every request has a lookup draft."""
        return bool(self.lookup) and all(self.lookup)


def chain_budget(K: int, lookup) -> int:
    """The drafter's tokens in a step of K speculative tokens (prompt lookup caps the drafter's chain)."""
    return min(K, lookup.falcon_tokens) if lookup is not None else K


def plan_step(K: int, req_ids: list, lookup=None, drafts: list[list[int]] | None = None,
              servable: bool = True) -> StepPlan:
    """The step's plan.  ``lookup``: the :class:`~falcon_vllm.core.lookup.LookupState` (None: prompt lookup off),
    ``drafts`` its drafts for ``req_ids`` this step; ``servable`` False: a batch whose drafts the verifier could not
    verify exactly (tree mode on Model Runner V2), which drafts nothing."""
    if not servable:
        return StepPlan(K, None, None, 0)
    if K == 0 or lookup is None or drafts is None:
        return StepPlan(K, None, None, chain_budget(K, lookup))
    lookup_only = lookup.falcon_max_batch is not None and len(req_ids) > lookup.falcon_max_batch
    withheld = [lookup_only or r in lookup.gapped for r in req_ids]
    plan = StepPlan(K, drafts, withheld, chain_budget(K, lookup), lookup_only)
    if plan.all_withheld or plan.all_matched:
        plan = plan._replace(chain=0)
    return plan
