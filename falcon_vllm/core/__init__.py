"""The drafting core, free of vLLM: what both model runners' adapters drive.

:mod:`~falcon_vllm.core.plan` decides each step (prompt lookup, the drafter's chain or tree, no drafts, rows kept for
the next pass); :mod:`~falcon_vllm.core.drafting` runs the drafter's passes through a runner adapter (V1's
:class:`falcon_vllm.vllm.proposer.FalconProposer`, Model Runner V2's
:class:`falcon_vllm.vllm.v2.speculator.FalconSpeculator`); :mod:`~falcon_vllm.core.stash` keeps each request's
relaxed-block rows between steps; :mod:`~falcon_vllm.core.lookup` is prompt lookup and the datastore;
:mod:`~falcon_vllm.core.tree_draft` drafts a tree; :mod:`~falcon_vllm.core.paged_kv` reads paged KV caches.
Nothing here imports vLLM (``tests/test_import_graph.py``).
"""
