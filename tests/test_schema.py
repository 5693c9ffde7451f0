"""The options schema: every key documented and bounded, old names read as aliases, serving.json read through it,
and docs/serving.md's key tables generated from it."""

import json
import re

import pytest

from falcon_vllm import schema
from falcon_vllm.schema import ALIASES, DOC, KEYS, FalconOptions, doc_with_tables, parse, read_serving


def test_every_key_is_documented_grouped_and_typed():
    assert KEYS, "no keys"
    for name, key in KEYS.items():
        assert key.group in (schema.DRAFTER, schema.LOOKUP, schema.DRAFTS), name
        assert key.doc and key.default, name
        if key.kind == "int":
            assert key.ge is not None, name  # every integer has its lower bound
        if key.kind == "number":
            assert (key.ge is None) != (key.gt is None) and (key.le is None) != (key.lt is None), name


@pytest.mark.parametrize("name", [n for n, k in KEYS.items() if k.kind in ("int", "number")])
def test_bounds_are_enforced_at_their_edges(name):
    key = KEYS[name]
    lo = key.ge if key.ge is not None else key.gt
    hi = key.le if key.le is not None else key.lt
    inside = [lo if key.ge is not None else lo + 0.5] + ([hi if key.le is not None else hi - 0.5] if hi else [])
    outside = [lo - 1 if key.ge is not None else lo] + ([hi + 1 if key.le is not None else hi] if hi else [])
    outside += [True, "3"]
    for v in inside:
        assert getattr(parse({name: v}, set())[0], name) == v
    for v in outside:
        with pytest.raises(ValueError, match=re.escape(f"falcon-vllm: {name} must be {key.expected()}")):
            parse({name: v}, set())


def test_old_names_are_aliases_and_two_names_for_one_key_are_refused():
    assert ALIASES == {"falcon_k": "drafter_k", "falcon_tokens": "drafter_tokens",
                       "falcon_max_batch": "drafter_max_batch"}
    new, _, names_new = parse({"drafter-tokens": 2, "drafter_max_batch": 3, "drafter_k": 2}, set())
    old, _, names_old = parse({"falcon_tokens": 2, "falcon-max-batch": 3, "falcon_k": 2}, set())
    assert new == old == FalconOptions(drafter_tokens=2, drafter_max_batch=3, drafter_k=2)
    assert names_old["drafter_max_batch"] == "falcon-max-batch"  # errors name a key as the user spelled it
    with pytest.raises(ValueError, match="falcon_tokens and drafter_tokens are the same key"):
        parse({"falcon_tokens": 2, "drafter_tokens": 2}, set())
    over, _, names = parse({"falcon_tokens": 9, "prompt_lookup_max": 3}, set())
    with pytest.raises(ValueError, match="falcon_tokens=9 is above num_speculative_tokens=8"):
        over.check(8, False, names)


def test_unknown_keys_and_vllm_keys():
    opts, rest, _ = parse({"method": "falcon", "enforce_eager": True}, {"enforce_eager", "method"})
    assert opts.method == "falcon" and rest == {"enforce_eager": True}
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['drafter_depth'\] in the speculative config"):
        parse({"drafter_depth": 2}, {"enforce_eager"})


def test_rules_between_keys():
    ok = FalconOptions(prompt_lookup_max=4, drafter_tokens=2)
    assert ok.check(8, False, {}) == (4, 4)
    for opts, n, tree_mode, match in [
            (FalconOptions(lookup_tokens=2), 8, False, "lookup_tokens only applies with prompt lookup"),
            (FalconOptions(prompt_lookup_min=4, prompt_lookup_max=2), 8, False, "need 1 <= prompt_lookup_min"),
            (FalconOptions(datastore_tokens=3), 8, False, "datastore_tokens comes with a datastore"),
            (FalconOptions(datastore="x.npz"), 8, False, "looked up with prompt lookup"),
            (FalconOptions(drafter_max_batch=2), 8, False, "drafter_max_batch comes with prompt lookup"),
            (FalconOptions(draft_temperature_scale=0.5), 8, False, "give draft_sample_method"),
            (ok, 8, True, "runs in chain mode"),
            (FalconOptions(draft_confidence=0.5), 8, True, "draft_confidence cuts chain drafts"),
            (FalconOptions(draft_sample_method="probabilistic"), 8, True, "runs in chain mode")]:
        with pytest.raises(ValueError, match=match):
            opts.check(n, tree_mode, {})


def test_serving_json_is_read_through_the_schema(tmp_path):
    f = tmp_path / "serving.json"

    def read(d):
        f.write_text(json.dumps(d))
        return read_serving(str(f))

    got = read({"num_speculative_tokens": 8, "falcon_tokens": 2, "prompt_lookup_max": 4,
                "num_speculative_tokens_per_batch_size_by_cpu": {"AVX512": [[1, 3, 8], [4, 64, 0]]}})
    assert got.options.drafter_tokens == 2 and got.for_cpu("AVX512").num_speculative_tokens_per_batch_size[0] == [1, 3, 8]
    assert got.for_cpu("AVX2").num_speculative_tokens_per_batch_size is None
    for bad, match in [({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
                       ({"num_speculative_tokens": 4, "drafter_tokens": "2"}, "drafter_tokens must be an integer"),
                       ({"num_speculative_tokens": 4, "prompt_lookup_mx": 3}, r"unknown option\(s\) \['prompt_lookup_mx'\]"),
                       ({"num_speculative_tokens": 4, "tree": "chain-4"}, "belong in the speculative config"),
                       ({"num_speculative_tokens": 4, "draft_confidence": 1}, r"draft_confidence must be a number in \[0, 1\)"),
                       ({"num_speculative_tokens": 4, "draft_confidence": 0.5, "draft_gemm_dtype": "int8"},
                        r"\['draft_confidence', 'draft_gemm_dtype'\] cannot be recommended by serving.json"),
                       ({"paths": [[0]], "draft_sample_method": "probabilistic"}, "needs a chain"),
                       ({"paths": [[0]], "k": 2, "num_speculative_tokens": 5, "prompt-lookup-max": 3, "falcon_tokens": 2},
                        r"\['falcon_tokens', 'num_speculative_tokens', 'prompt-lookup-max'\] belong to the chain form"),
                       ({"num_speculative_tokens": None, "num_speculative_tokens_per_batch_size": [[1, 4, 2]]},
                        "must be a `falcon-vllm tune-tree` file"),
                       ({"k": 2}, "must be a `falcon-vllm tune-tree` file")]:
        with pytest.raises(ValueError, match=match) as e:
            read(bad)
        assert str(f) in str(e.value)  # errors name the file
    assert read({"paths": [[0], [1]]}).tree_file == str(f)


def test_shipped_serving_json_uses_the_current_names():
    from falcon_vllm.vllm.options import shipped_drafters

    for d in shipped_drafters():
        f = d / "serving.json"
        if f.exists():
            assert not set(json.loads(f.read_text())) & set(ALIASES), f
            read_serving(str(f))


def test_serving_md_key_tables_are_generated_from_the_schema():
    text = DOC.read_text()
    assert doc_with_tables(text) == text, "docs/serving.md is behind the schema: run python -m falcon_vllm.schema --write"
    for name in KEYS:
        assert f"`{name}`" in text, name
