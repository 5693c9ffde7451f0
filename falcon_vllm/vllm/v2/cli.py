"""The same user interface on vLLM 0.34 as on 0.32/0.33: the older flags and Falcon's keys at the top level.

On 0.32/0.33 the plugin's config hook (:mod:`falcon_vllm.vllm.hooks`) takes ``{"method": "falcon", ...}`` with
Falcon's keys beside vLLM's, and adds ``--speculative-model`` / ``--num-speculative-tokens``.  On 0.34 vLLM builds
the config itself (``register_speculative_method``), and a method's own keys go in ``speculator_options``; so that a
config written for 0.32 works unchanged, :func:`install` wraps ``EngineArgs.create_speculative_config`` to move
Falcon's keys (:mod:`falcon_vllm.schema`, old names included) that are not the speculative config's own fields into
``speculator_options`` before vLLM reads the dict, and adds the older flags as on 0.32.  Both spellings work:
``{"method": "falcon", "prompt_lookup_max": 4}`` and ``{"method": "falcon", "speculator_options":
{"prompt_lookup_max": 4}}``.
"""

from __future__ import annotations

from falcon_vllm.vllm import patches
from falcon_vllm.vllm.v2.rules import SPEC_FIELDS

ENGINE_ARGS = "vllm.engine.arg_utils:EngineArgs"


def install() -> None:
    """Wrap ``EngineArgs``' config and CLI methods (idempotent)."""
    from falcon_vllm.vllm.hooks import _add_cli_args, _from_cli_args

    args = patches.resolve(ENGINE_ARGS)
    patches.wrap(args, "create_speculative_config", _falcon_keys_to_options)
    patches.wrap(args, "add_cli_args", _add_cli_args)
    patches.wrap(args, "from_cli_args", _from_cli_args)


def falcon_keys_to_options(sc: dict, fields=SPEC_FIELDS) -> dict:
    """A ``{"method": "falcon", ...}`` dict with Falcon's keys other than the speculative-config ``fields`` it reads
    moved into ``speculator_options`` (a key given both ways is refused); any other dict unchanged."""
    from falcon_vllm.schema import ALIASES, KEYS

    if not isinstance(sc, dict) or sc.get("method") != "falcon":
        return sc
    ours = set(KEYS) | set(ALIASES)
    keep = set(fields) | {"method"}
    move = {k: v for k, v in sc.items() if k.replace("-", "_") in ours and k.replace("-", "_") not in keep}
    if not move:
        return sc
    spelled = [k.replace("-", "_") for k in move]
    if twice := sorted({k for k in spelled if spelled.count(k) > 1}):
        raise ValueError(f"falcon-vllm: {twice} given twice in the speculative config (with '-' and '_'): give each "
                         "once")
    options = dict(sc.get("speculator_options") or {})
    if both := sorted(set(options) & set(spelled)):
        raise ValueError(f"falcon-vllm: {both} given both in the speculative config and in its speculator_options: "
                         "give each once")
    options.update({k.replace("-", "_"): v for k, v in move.items()})
    return {**{k: v for k, v in sc.items() if k not in move}, "speculator_options": options}


def _falcon_keys_to_options(orig):
    def create_speculative_config(self, *args, **kwargs):
        sc = self.speculative_config
        moved = falcon_keys_to_options(sc)
        if moved is sc:
            return orig(self, *args, **kwargs)
        self.speculative_config = moved
        try:
            return orig(self, *args, **kwargs)
        finally:  # leave the user's EngineArgs as given
            self.speculative_config = sc

    return create_speculative_config
