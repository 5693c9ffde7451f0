"""What Falcon on Model Runner V2 does not do yet, refused at start-up on every vLLM that runs V2 (no vLLM import).

Used by the 0.34 speculator config (:mod:`falcon_vllm.vllm.v2.config`), by the config hook on 0.32/0.33 when
``VLLM_USE_V2_MODEL_RUNNER=1`` (:mod:`falcon_vllm.vllm.hooks`) and by the speculator itself, so every path refuses
the same things with the same words.  The drafter's ``serving.json`` applies on V2 as on V1 (a tune-tree file, or
prompt lookup, the datastore, the batch-size schedule and sampled drafts).
"""

from __future__ import annotations

# the SpeculativeConfig fields Falcon's option resolution reads on 0.34; its other keys go in speculator_options
SPEC_FIELDS = ("model", "num_speculative_tokens", "draft_sample_method", "num_speculative_tokens_per_batch_size")


def check_v2(serving) -> None:
    """Refuse what the V2 speculator does not do yet (``serving``: a :class:`~falcon_vllm.serving.Serving`)."""
    if serving.level_embedding:
        raise ValueError(
            "falcon-vllm: this drafter was trained with level embeddings, which the Model Runner V2 speculator does "
            "not feed yet. Use a drafter trained without --level-embedding, or vLLM 0.32/0.33's V1 runner")


def check_block_rows(k: int, K: int, max_num_reqs: int, max_num_batched_tokens: int) -> None:
    """A block pass lays out k rows per request in the drafter's buffers, which vLLM sizes to
    ``max_num_batched_tokens``: a full batch must fit (a verification step needs only K + 1 rows a request)."""
    if max_num_reqs * k > max_num_batched_tokens:
        raise ValueError(
            f"falcon-vllm: the drafter's block passes need max_num_seqs x k = {max_num_reqs} x {k} rows, more than "
            f"max_num_batched_tokens ({max_num_batched_tokens}) that Model Runner V2 sizes the drafter's buffers to "
            f"(K = {K}); raise max_num_batched_tokens or lower max_num_seqs")


def check_data_parallel(vllm_config) -> None:
    """The block passes run a different number of rows on each data-parallel rank without syncing them, which a
    data-parallel MoE target (its experts' all-to-all across ranks) would wait on forever: refused."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "data_parallel_size", 1) > 1 and getattr(vllm_config.model_config, "is_moe", False):
        raise ValueError(
            f"falcon-vllm: data parallelism (data_parallel_size={parallel.data_parallel_size}) with a mixture-of-"
            "experts target is not supported on Model Runner V2: the drafter's block passes do not sync their row "
            "counts across ranks. Use tensor parallelism, or data_parallel_size 1")
