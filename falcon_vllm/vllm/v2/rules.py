"""What Falcon on Model Runner V2 does not do yet, refused at start-up on every vLLM that runs V2 (no vLLM import).

Used by the 0.34 speculator config (:mod:`falcon_vllm.vllm.v2.config`) and by the config hook on 0.32/0.33
when ``VLLM_USE_V2_MODEL_RUNNER=1`` (:mod:`falcon_vllm.vllm.hooks`), so both runners refuse the same things with
the same words.  Both resolve the options without the drafter's ``serving.json`` (``recommend=False``): it was
tuned for the V1 runner's modes (prompt lookup, the datastore, trees, a draft temperature scale), so on V2 a
chain is the drafter's 2k tokens unless ``num_speculative_tokens`` is given, and what this module refuses is only
ever what the user asked for.
"""

from __future__ import annotations

from falcon_vllm.vllm.options import ragged_drafts


def check_v2(falcon: dict) -> None:
    """Refuse what the V2 speculator does not do yet; ``falcon`` is a resolved Falcon config (the drafter's
    ``hf_config.falcon``: :func:`~falcon_vllm.vllm.options.resolve_falcon_config`'s info over the checkpoint's
    section)."""
    if falcon.get("mode") == "tree":
        raise ValueError(
            f"falcon-vllm: tree mode (tree {falcon.get('tree_name')!r}) does not run on Model Runner V2: it has no "
            "tree verification (vLLM removed tree attention) and the plugin's tree positions, ancestor mask, tree "
            "sampler and KV compaction are not ported yet (docs/vllm-0.34-port.md, section 4). Give a chain "
            "(num_speculative_tokens, no tree), or serve tree mode in vLLM 0.32/0.33's V1 runner "
            "(VLLM_USE_V2_MODEL_RUNNER unset)")
    if (ragged := ragged_drafts(falcon)) is not None:
        raise ValueError(
            f"falcon-vllm: {ragged} gives requests drafts of different lengths, which the plugin does not yet pass "
            "to Model Runner V2 (it schedules every request the same draft length). Drop it, or use vLLM 0.32/0.33's "
            "V1 runner (VLLM_USE_V2_MODEL_RUNNER unset)")
    if falcon.get("draft_temperature_scale", 1.0) != 1.0:
        raise ValueError(
            "falcon-vllm: draft_temperature_scale is not applied by the Model Runner V2 speculator yet (its sampled "
            "drafts are drawn at the request's temperature). Drop it, or use vLLM 0.32/0.33's V1 runner")
    if falcon.get("level_embedding"):
        raise ValueError(
            "falcon-vllm: this drafter was trained with level embeddings, which the Model Runner V2 speculator does "
            "not feed yet. Use a drafter trained without --level-embedding, or vLLM 0.32/0.33's V1 runner")
