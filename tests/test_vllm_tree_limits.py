"""What tree mode refuses at start-up, and what it does with requests it cannot draft for exactly.

Start-up: every attention feature tree attention lacks (sliding window, soft-cap, ALiBi, sinks,
quantised KV, KV sharing, other backends or CPU ISAs, kernel head sizes, several KV-cache groups)
is one ``falcon-vllm:`` error naming the setting, raised while the engine starts (CPU, in-process).
"""

import pytest
import torch



def _fa(**kw):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    a = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None, sliding_window=None,
             kv_cache_dtype="auto")
    a.update(kw)
    return FlashAttentionImpl(**a)


class _Layer:
    def __init__(self, impl):
        self.impl, self.kv_cache = impl, torch.zeros(1)


@pytest.mark.parametrize("setting,match", [
    ({}, None),
    ({"sliding_window": 64}, "sliding-window attention"),
    ({"logits_soft_cap": 30.0}, "soft-capping"),
    ({"alibi_slopes": [0.5] * 4}, "ALiBi"),
    ({"sinks": torch.zeros(4)}, "attention sinks"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "fp8_e4m3 KV cache"),
    ({"kv_sharing_target_layer_name": "l0"}, "KV-cache sharing"),
    ({"head_size": 80}, "head size 80"),
])
def test_flash_attention_features_are_refused(setting, match):
    """vLLM's own FlashAttentionImpl (constructed on CPU) with each setting; fields its CUDA-only
    constructor rejects here (sinks, fp8) are set on the built impl as __init__ stores them."""
    from falcon_vllm.vllm.tree_verify import _unsupported

    late = {k: setting[k] for k in ("sinks", "kv_cache_dtype") if k in setting}
    impl = _fa(**{k: v for k, v in setting.items() if k not in late})
    for k, v in late.items():
        setattr(impl, k, v)
    what = _unsupported("l0", _Layer(impl))
    assert (what is None) if match is None else (match in what), what


def test_other_backends_and_groups_are_refused():
    from falcon_vllm.vllm.tree_verify import _unsupported, check_startup

    class TritonAttentionImpl:
        pass

    assert "TritonAttentionImpl is not supported" in _unsupported("l0", _Layer(TritonAttentionImpl()))

    class Group:
        def __init__(self, names):
            self.layer_names = names

    class Cfg:
        kv_cache_groups = [Group(["t0", "d0"]), Group(["t1"])]

    class VC:
        class compilation_config:
            static_forward_context = {}

    with pytest.raises(ValueError, match="^falcon-vllm: tree mode does not support a target whose KV cache spans"):
        check_startup(VC, Cfg, ["d0"])
    Cfg.kv_cache_groups = [Group(["t0", "t1"]), Group(["d0"])]  # the drafter's own group is fine
    check_startup(VC, Cfg, ["d0"])


# ---------------------------------------------------------------------------- sampling features
V = 49152
PROMPTS = [[11, 12, 13], list(range(200, 237)), [5] * 9, list(range(1000, 1020))]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from tests.vllm_util import EngineCache, save_target

    from falcon_vllm.testing import random_drafter, tiny_llama

    base = tmp_path_factory.mktemp("features")
    rnd = tiny_llama(vocab=V, hidden=64, heads=2, kv_heads=1, seed=5)
    save_target(rnd, str(base / "rnd"))
    random_drafter(rnd, k=2, fusion="lstm").save_pretrained(str(base / "rnd_k2"))
    spec = {"method": "falcon", "model": str(base / "rnd_k2"), "tree": "tree-3x2x2x1"}
    kw = {"per_request_spec_decode_metrics": "summary"}
    e = EngineCache({"vanilla": (str(base / "rnd"), None, {}), "tree": (str(base / "rnd"), spec, kw)})
    yield e
    e.close()


def _features(first_tokens):
    """name -> SamplingParams kwargs (greedy: outputs are deterministic, so compared token by token).
    min_p and logit_bias are not here: vLLM 0.32 rejects them for every speculative method."""
    return {
        "penalties": dict(repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4),
        "min_tokens": dict(min_tokens=12, stop_token_ids=list(range(2, V // 2)), ignore_eos=False),
        "allowed_token_ids": dict(allowed_token_ids=list(range(100, 400))),
    }


def _run(llm, params):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS for _ in params],
                        [SamplingParams(max_tokens=24, temperature=0, **({"ignore_eos": True} | kw))
                         for _ in PROMPTS for kw in params], use_tqdm=False)
    return outs


def test_sampling_features_are_exact_and_turn_drafting_off_per_request(engines):
    """Each feature vLLM's sampler applies beyond temperature/top-k/top-p, mixed in one batch with
    plain greedy requests: every output equals vanilla vLLM's; the feature requests drafted nothing
    while the plain requests kept their trees."""
    from vllm import SamplingParams

    first = engines.get("vanilla").generate([{"prompt_token_ids": PROMPTS[0]}],
                                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                                            use_tqdm=False)[0].outputs[0].token_ids
    feats = _features(list(first))
    params = [{}] + list(feats.values())
    want = [list(o.outputs[0].token_ids) for o in _run(engines.get("vanilla"), params)]
    stopped = want[1 + list(feats).index("min_tokens")]
    assert 12 <= len(stopped) < 24 and stopped[-1] < V // 2            # stop tokens held back for 12 tokens
    outs = _run(engines.get("tree"), params)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == want
    drafted = [(o.outputs[0].spec_decode_metrics.to_dict()["num_draft_tokens"]
                if o.outputs[0].spec_decode_metrics is not None else 0) for o in outs]
    for i, d in enumerate(drafted):
        assert (d > 0) if i % len(params) == 0 else (d == 0), (i, drafted)
