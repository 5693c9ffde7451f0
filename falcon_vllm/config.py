"""FalconConfig: the drafter's hyper-parameters, stored as a Hugging Face-style ``config.json``.

The file is a valid Llama (or Qwen2) config, so vLLM and transformers can parse it, with the
Falcon-specific settings under the ``"falcon"`` key::

    {"model_type": "llama", "architectures": ["EagleFalconForCausalLM"], "hidden_size": 576, ...,
     "num_hidden_layers": 1,
     "falcon": {"k": 2, "fusion": "lstm", "tree": "falcon-llama", "format_version": 1,
                "target": {"hidden_size": 576, "vocab_size": 49152, "model_type": "llama"}}}
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

FORMAT_VERSION = 1
ARCHITECTURE = "EagleFalconForCausalLM"  # name starts with "Eagle" so vLLM's EAGLEConfig keeps it
FUSIONS = ("lstm", "fc")
BLOCK_ORDERS = ("forward", "reversed")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def _stored(default=MISSING, *, key: str | None = None, section: str = "", optional: bool = False,
            factory=MISSING):
    """A field of FalconConfig and where ``config.json`` stores it: under ``key`` (default: the field's name) at the
    top level (``section=""``, what vLLM and transformers read) or in the ``"falcon"`` section; ``optional``: left out
    of the file while it has its default."""
    meta = {"key": key, "section": section, "optional": optional}
    return field(default_factory=factory, metadata=meta) if factory is not MISSING else field(default=default,
                                                                                             metadata=meta)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# how a stored value is checked and read back, by the field's annotation: (accepts, converts, what it must be)
_READ = {"int": (_is_int, int, "an integer"), "int | None": (_is_int, int, "an integer"),
         "float": (lambda v: _is_int(v) or isinstance(v, float), float, "a number"),
         "bool": (lambda v: isinstance(v, bool), bool, "true or false"),
         "str": (lambda v: isinstance(v, str), str, "a string"),
         "str | None": (lambda v: isinstance(v, (str, list)), lambda v: v, "a string or a list of paths"),
         "tuple[int, ...]": (lambda v: isinstance(v, list) and all(map(_is_int, v)), tuple, "a list of integers"),
         "dict[str, Any]": (lambda v: isinstance(v, dict), dict, "an object")}


@dataclass
class FalconConfig:
    hidden_size: int = _stored()
    num_attention_heads: int = _stored()
    num_key_value_heads: int = _stored()  # stored files without it: num_attention_heads
    intermediate_size: int = _stored()
    vocab_size: int = _stored()
    head_dim: int | None = _stored(None)
    num_layers: int = _stored(1, key="num_hidden_layers")
    k: int = _stored(2, section="falcon")
    fusion: str = _stored("lstm", section="falcon")
    rms_norm_eps: float = _stored(1e-6)
    rope_theta: float = _stored(10000.0)  # also written as rope_parameters, read from there first
    attention_bias: bool = _stored(False, key="qkv_bias")  # q/k/v biases (Qwen2 layers)
    fc_bias: bool = _stored(False, section="falcon")  # bias of the fc fusion (vLLM's EAGLE layout has none)
    # which block position outputs which level: "forward" (the paper's: position r of a block -> level r+1)
    # or "reversed" (the block's last position, the one whose input is newest, -> level 1; see drafter.py)
    block_order: str = _stored("forward", section="falcon", optional=True)
    # a learned vector per block row (offset 0..k-1 inside its end-aligned block) added to the fused input:
    # rows of one block see the same keys, so without it a row tells its level only through rotary offsets
    level_embedding: bool = _stored(False, section="falcon", optional=True)
    max_position_embeddings: int = _stored(4096)
    model_type: str = _stored("llama")
    tree: str | None = _stored(None, section="falcon")  # default decoding tree (preset name or list string)
    # truncated draft head: its N target tokens (None = the target's head)
    draft_vocab_size: int | None = _stored(None, optional=True)
    # the truncated head is the target's LM-head rows of its N tokens, never trained: the checkpoint stores only
    # d2t and the rows are taken from the target when the drafter is loaded (top-level ``frozen_head`` key)
    frozen_head: bool = _stored(False, optional=True)
    # target layers whose input states (EAGLE-3's low/mid/high features) the drafter also reads at target
    # positions (gen-data --aux-layers); () = the final-norm states alone
    aux_layers: tuple[int, ...] = _stored((), section="falcon", optional=True)
    target: dict[str, Any] = _stored(factory=dict, section="falcon")  # what the drafter was trained for
    extra: dict[str, Any] = _stored(factory=dict, section="falcon", optional=True)  # training provenance etc.

    def __post_init__(self):
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"falcon-vllm: {name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.fusion not in FUSIONS:
            raise ValueError(f"falcon-vllm: fusion must be one of {FUSIONS}, got {self.fusion!r}")
        if self.block_order not in BLOCK_ORDERS:
            raise ValueError(f"falcon-vllm: block_order must be one of {BLOCK_ORDERS}, got {self.block_order!r}")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"falcon-vllm: k (tokens per drafter pass) must be an integer >= 1, got {self.k!r}")
        if self.num_layers < 1:
            raise ValueError(f"falcon-vllm: num_layers must be >= 1, got {self.num_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("falcon-vllm: num_attention_heads must be a multiple of num_key_value_heads")
        self.aux_layers = tuple(int(i) for i in self.aux_layers)
        if any(i < 1 for i in self.aux_layers) or len(set(self.aux_layers)) != len(self.aux_layers):
            raise ValueError(f"falcon-vllm: aux_layers must be distinct target layers >= 1, got {list(self.aux_layers)}")
        if self.draft_vocab_size == self.vocab_size:
            self.draft_vocab_size = None
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size < self.vocab_size:
            raise ValueError(f"falcon-vllm: draft_vocab_size must be in [1, vocab_size={self.vocab_size}) "
                             f"got {self.draft_vocab_size}")
        if self.frozen_head and not self.draft_vocab_size:
            raise ValueError("falcon-vllm: frozen_head needs a truncated head (draft_vocab_size); without one the "
                             "drafter uses the target's whole head anyway")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"falcon-vllm: model_type {self.model_type!r} is not supported "
                             f"(supported: {SUPPORTED_MODEL_TYPES})")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(cls, target_config, k: int = 2, fusion: str = "lstm", num_layers: int = 1,
                    tree: str | None = None, **overrides) -> "FalconConfig":
        """Drafter config whose decoder layers match the target's layer shapes."""
        tc = target_config
        model_type = getattr(tc, "model_type", "llama")
        rope = getattr(tc, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
        kw = dict(
            hidden_size=tc.hidden_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", tc.num_attention_heads),
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            intermediate_size=tc.intermediate_size,
            vocab_size=tc.vocab_size,
            num_layers=num_layers, k=k, fusion=fusion,
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=float(rope_theta),
            attention_bias=bool(getattr(tc, "attention_bias", model_type == "qwen2")),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 4096),
            model_type=model_type if model_type in SUPPORTED_MODEL_TYPES else "llama",
            tree=tree,
            target=target_signature(tc),
        )
        kw.update(overrides)
        return cls(**kw)

    # ------------------------------------------------------------------ checks
    def target_problems(self, target_config, recorded: bool = False) -> list[str]:
        """Why this drafter does not fit ``target_config`` ([] when it does): it runs only on the hidden
        size and vocabulary it has; with ``recorded``, each property of the target it was trained for
        (``falcon.target``: hidden size, vocabulary, number of layers, model type) must match too."""
        problems = []
        if self.hidden_size != target_config.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != target's {target_config.hidden_size}")
        if self.vocab_size != target_config.vocab_size:
            problems.append(f"vocabulary {self.vocab_size} != target's {target_config.vocab_size}")
        if recorded:
            trained = self.target or {}
            problems += [f"trained for {k}={trained[k]!r} != target's {v!r}"
                         for k, v in target_signature(target_config).items()
                         if k != "name" and trained.get(k) is not None and trained[k] != v]
        return problems

    def check_target(self, target_config) -> None:
        """Raise ValueError if this drafter cannot run on ``target_config``."""
        problems = self.target_problems(target_config)
        if problems:
            raise ValueError("falcon-vllm: this Falcon drafter was built for another target: " + "; ".join(problems)
                             + f" (drafter trained for {self.target or 'unknown target'}); train one for "
                             "this target with `falcon-vllm train`")

    # ------------------------------------------------------------------ (de)serialisation
    def to_hf_dict(self) -> dict:
        top, falcon = {"architectures": [ARCHITECTURE]}, {"format_version": FORMAT_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["optional"] and value == _default(f):
                continue
            section = falcon if f.metadata["section"] == "falcon" else top
            section[f.metadata["key"] or f.name] = list(value) if isinstance(value, tuple) else value
        return {**top,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                # our layers have q/k/v biases only (Qwen2 style): `qkv_bias`, never an o_proj bias
                "attention_bias": False,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "torch_dtype": "float32",
                "falcon": falcon}

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config") -> "FalconConfig":
        if "falcon" not in d or not isinstance(d["falcon"], dict):
            raise ValueError(f"falcon-vllm: {source} is not a Falcon drafter config (no 'falcon' section); "
                             "convert official checkpoints with `falcon-vllm convert`")
        rope = d.get("rope_parameters") or {}
        top = {**d, "rope_theta": rope.get("rope_theta", d.get("rope_theta")),
               "qkv_bias": d.get("qkv_bias", d.get("attention_bias")),
               "num_key_value_heads": d.get("num_key_value_heads", d.get("num_attention_heads"))}
        kw = {}
        for f in fields(cls):
            key = f.metadata["key"] or f.name
            value = (d["falcon"] if f.metadata["section"] == "falcon" else top).get(key)
            if value is None:
                if _default(f) is MISSING:
                    raise ValueError(f"falcon-vllm: {source}: missing key {key!r} in the drafter config")
                continue
            accepts, read, what = _READ[f.type]
            if not accepts(value):
                raise ValueError(f"falcon-vllm: {source}: {key} must be {what}, got {value!r}")
            kw[f.name] = read(value)
        try:
            return cls(**kw)
        except ValueError as e:  # the rules between fields (__post_init__), with the file named
            raise ValueError(str(e).replace("falcon-vllm: ", f"falcon-vllm: {source}: ", 1)) from None

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(self.to_hf_dict(), f, indent=2)

    @classmethod
    def load(cls, directory: str) -> "FalconConfig":
        d, path = read_config_json(directory)
        return cls.from_hf_dict(d, source=path)

    def as_dict(self) -> dict:
        return asdict(self)


def _default(f):
    """A FalconConfig field's default (MISSING for a required one)."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def read_config_json(directory: str, kind: str = "Falcon drafter") -> tuple[dict, str]:
    """(parsed config.json, its path) of a drafter directory, with one clear error per way it can be wrong."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"falcon-vllm: {kind} directory {directory!r} does not exist")
    if not os.path.exists(path):
        raise ValueError(f"falcon-vllm: {directory!r} is not a {kind}: it has no config.json")
    try:
        with open(path) as f:
            return json.load(f), path
    except json.JSONDecodeError as e:
        raise ValueError(f"falcon-vllm: {path} is not valid JSON: {e}") from None


def dir_name(path) -> str:
    """A directory's name, as recorded files give it (a model, a drafter, a data set): never the machine's path."""
    return os.path.basename(str(path).rstrip("/"))


def target_signature(target_config) -> dict:
    """What identifies a target for a drafter: shapes and (if known) its name (a directory's last component: a
    drafter's config names no machine path)."""
    name = getattr(target_config, "_name_or_path", None) or None
    return {
        "model_type": getattr(target_config, "model_type", None),
        "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size,
        "num_hidden_layers": getattr(target_config, "num_hidden_layers", None),
        "name": dir_name(name) if name else None,
    }
