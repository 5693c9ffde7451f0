"""The resolved serving options (falcon_vllm.serving.Serving): one typed object, the only reader of their keys."""

import re
from pathlib import Path

from falcon_vllm.serving import Lookup, Serving

ROOT = Path(__file__).resolve().parent.parent


def test_section_round_trip():
    """What crosses to the workers (flat keys in the drafter's hf_config.falcon, beside the checkpoint's) reads back
    as the same object; options at their defaults are not written."""
    checkpoint = {"k": 3, "block_order": "reversed", "fusion": "fc"}
    look = Serving(k=3, block_order="reversed", num_speculative_tokens=8, draft_confidence=0.25,
                   lookup=Lookup(2, 4, drafter_tokens=2, lookup_tokens=4, drafter_max_batch=3, datastore="/x.npz",
                                 datastore_max_batch=1))
    tree = Serving(k=3, block_order="reversed", mode="tree", num_speculative_tokens=3, tree=[[0], [1], [0, 0]],
                   tree_name="custom", subtrees={2: [[0], [1]]}, draft_gemm_dtype="bfloat16")
    for s in (look, tree, Serving(k=3, block_order="reversed", num_speculative_tokens=6)):
        section = dict(checkpoint, **s.section())
        assert Serving.from_section(section) == s
    assert "draft_temperature_scale" not in look.section() and "draft_gemm_dtype" not in look.section()
    assert look.ragged == "prompt lookup (prompt_lookup_max) and draft_confidence" and tree.ragged is None


OPTION_KEYS = ("mode", "tree_name", "subtrees", "draft_gemm_dtype", "draft_confidence", "draft_temperature_scale",
               "prompt_lookup", "prompt_lookup_min", "prompt_lookup_max", "drafter_tokens", "falcon_tokens",
               "lookup_tokens", "drafter_max_batch", "falcon_max_batch", "datastore_tokens", "datastore_max_batch")


def test_no_option_key_is_read_outside_the_typed_object():
    """The serving path reads its options as attributes: no module of the package but the typed object's (and the
    schema, which parses the user's config) reads one of their keys out of a dict."""
    keys = "|".join(OPTION_KEYS)
    read = re.compile(rf"""(\[\s*["']({keys})["']\s*\]|\.get\(\s*["']({keys})["'])""")
    skip = {"serving.py", "schema.py"}
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted((ROOT / "falcon_vllm").rglob("*.py")) if p.name not in skip and "train" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if read.search(line)]
    assert not found, found
