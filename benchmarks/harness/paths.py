"""Where the repository, the results and the shipped drafters are; results never name this machine's paths."""

from __future__ import annotations

import os
import re

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
ROOT = os.path.dirname(BENCH)  # the repository
RESULTS = os.path.join(BENCH, "results")
DEFAULT_DRAFTER = os.path.join(ROOT, "falcon_vllm", "drafters", "smollm2-135m-instruct")
DEFAULT_EAGLE = DEFAULT_DRAFTER + "-eagle"


def drafters_for(model: str | None, drafter: str | None, eagle: str | None) -> tuple[str, str]:
    """(Falcon drafter, EAGLE-1 drafter) a benchmark of ``model`` uses where the command gives none: the drafter
    shipped for that target (as ``"model": "falcon"`` resolves it; an error names what was tried) and its
    ``-eagle`` sibling; SmolLM2's pair when no model is given or none is shipped for it."""
    if model is None:
        return drafter or DEFAULT_DRAFTER, eagle or DEFAULT_EAGLE
    if drafter is None or eagle is None:
        from transformers import AutoConfig

        from falcon_vllm.vllm.options import resolve_drafter

        try:
            shipped = resolve_drafter("falcon", AutoConfig.from_pretrained(model))
        except ValueError:  # none for this target: configurations without a drafter still run; the others fail
            return drafter or DEFAULT_DRAFTER, eagle or DEFAULT_EAGLE  # on the plugin's wrong-target error
        drafter, eagle = drafter or shipped, eagle or shipped.rstrip("/") + "-eagle"
    return drafter, eagle


def portable(value):
    """A setting as it may appear in committed results: a path inside the repository becomes relative to it,
    any other absolute path its last component; other values stay as they are."""
    if isinstance(value, str) and os.path.isabs(value):
        if value.startswith(ROOT + os.sep):
            return os.path.relpath(value, ROOT)
        return os.path.basename(value.rstrip("/"))
    return value


ABS_PATH = re.compile(r"(?<![\w./])/[^\s,:@'\"=]+")  # an absolute path inside a command or configuration label


def portable_text(text: str) -> str:
    """``text`` (a command, a configuration label such as ``tree:/abs/tree.json``) with each absolute path made
    :func:`portable`."""
    return ABS_PATH.sub(lambda m: portable(m.group(0)), text)
