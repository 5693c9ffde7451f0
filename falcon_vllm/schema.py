"""One schema for the speculative-config keys the plugin reads, and for a drafter's ``serving.json``.

:class:`FalconOptions` holds every key, grouped, each with its meaning, default and bounds (field metadata, as
vLLM's ``SpeculativeConfig`` documents its fields).  :func:`parse` reads a config dict through it (``-`` or ``_``,
old names as aliases, each value checked against its bounds); :meth:`FalconOptions.check` holds the rules between
keys; :func:`read_serving` reads ``serving.json`` through the same fields.  ``python -m falcon_vllm.schema`` prints
the key tables of ``docs/serving.md``, ``--write`` puts them there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from falcon_vllm.tree import TreeFile, load_json as _load_json, preset_list, read_tree_file  # noqa: F401

DRAFTER, LOOKUP, DRAFTS = ("Drafter and mode", "Prompt lookup and the datastore (chain mode)",
                           "How drafts are drawn and cut (chain mode)")
GEMM_DTYPES = ("auto", "bfloat16", "int8", "model")  # draft_gemm_dtype: falcon_vllm.vllm.model.gemm_dtype
MAX_CHAIN_TOKENS = 128  # vLLM's rejection sampler verifies at most this many speculative tokens per step
MAX_TREE_NODES = 512    # tree mode's own sampler: nodes per request and step


def check_chain_length(n: int) -> None:
    """Refuse a chain longer than vLLM's rejection sampler verifies in one step."""
    if n > MAX_CHAIN_TOKENS:
        raise ValueError(f"falcon-vllm: a chain of {n} speculative tokens is above the {MAX_CHAIN_TOKENS} that "
                         "vLLM's rejection sampler verifies per step; use a shorter chain or a tree")

# vLLM keys that contradict how Falcon drafts: (key, allowed values, why)
INCOMPATIBLE = (
    ("parallel_drafting", (False, None), "Falcon drafts k tokens per pass semi-autoregressively"),
    ("use_heterogeneous_vocab", (False, None), "the drafter shares the target's vocabulary"),
)


@dataclass(frozen=True)
class Key:
    """How one key is documented and checked."""
    group: str
    doc: str                    # its meaning, one sentence
    default: str                # what applies when it is not given
    rules: str = ""             # rules beyond its bounds
    kind: str = "int"           # int | number | choice | str | tree | path_or_false | schedule
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple = ()
    aliases: tuple[str, ...] = ()  # older names, still read
    vllm: bool = False          # one of vLLM's SpeculativeConfig fields, which the plugin interprets

    def expected(self) -> str:
        if self.kind == "int":
            return f"an integer >= {self.ge:g}"
        if self.kind == "number":
            lo = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}"
            hi = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})"
            return f"a number in {lo}, {hi}"
        return {"choice": f"one of {list(self.choices)}", "str": "a string",
                "tree": "a preset name, a list of rank paths or a tree file's path",
                "path_or_false": "a file's path (a string) or false",
                "schedule": "a list of [min batch size, max batch size, K]"}[self.kind]

    def accepts(self, v) -> bool:
        if self.kind in ("int", "number"):
            if isinstance(v, bool) or not isinstance(v, int if self.kind == "int" else (int, float)):
                return False
            return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                    and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))
        if self.kind == "choice":
            return v in self.choices
        if self.kind == "str":
            return isinstance(v, str)
        if self.kind == "tree":
            return isinstance(v, (str, list))
        if self.kind == "path_or_false":
            return isinstance(v, str) or v is False
        return isinstance(v, (list, tuple)) and all(  # schedule
            isinstance(r, (list, tuple)) and len(r) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r) and r[0] <= r[1] for r in v)

    def bounds(self) -> str:
        text = {"int": self.expected().replace("an integer ", "integer "), "number": self.expected()[2:],
                "choice": "one of " + ", ".join(f"`{c}`" for c in self.choices)}.get(self.kind, "")
        return "; ".join(t for t in (text, self.rules) if t)


def _key(group: str, doc: str, default: str, rules: str = "", **kw):
    return field(default=None, metadata={"key": Key(group, doc, default, rules, **kw)})


@dataclass(frozen=True)
class FalconOptions:
    """The speculative-config keys the plugin reads; None: not given."""

    method: str | None = _key(
        DRAFTER, '`"falcon"` selects this plugin', "-", "required (or `--speculative-model`)", kind="str", vllm=True)
    model: str | None = _key(
        DRAFTER, 'the drafter: a directory, or `"falcon"` to resolve one', "resolved as above",
        "a Falcon drafter directory", kind="str", vllm=True)
    tree: str | list | None = _key(
        DRAFTER, f"a preset ({preset_list()}), a list of rank paths (`[[0], [1], [0, 0]]`) or a JSON file (a list of "
        "paths, `{\"tree\": paths}`, or a `falcon-vllm tune-tree` file)", "none: a chain",
        f"duplicate or orphan paths refused; at most {MAX_TREE_NODES} nodes, ranks within the drafter's vocabulary; "
        "a tune-tree file fitted for the drafter's `k`; a chain runs in chain mode, any other tree (and any tune-tree "
        "file) in tree mode, which refuses prompt lookup, sampled drafts, `draft_confidence` and a "
        "`rejection_sample_method` other than `standard`", kind="tree")
    drafter_k: int | None = _key(
        DRAFTER, "the block size the drafter must have been trained with (a consistency check)", "not checked",
        "must equal the drafter's `k`", ge=1, aliases=("falcon_k",))
    num_speculative_tokens: int | None = _key(
        DRAFTER, "draft tokens per step: a chain's length, or the tree's node count",
        "`serving.json`'s, else the tree's nodes, else 2k",
        f"a chain at most {MAX_CHAIN_TOKENS} (vLLM's rejection sampler); with `tree` it must equal the tree's "
        "nodes; given alone it gives a plain chain and bypasses `serving.json`", ge=1, vllm=True)
    num_speculative_tokens_per_batch_size: list | None = _key(
        DRAFTER, "the draft length per batch-size range, `[[lo, hi, K], ...]` (K = 0: drafting off)",
        "`serving.json`'s; a tune-tree file's own schedule in tree mode",
        "`lo <= hi`, `K <= num_speculative_tokens`", kind="schedule", vllm=True)

    prompt_lookup_min: int | None = _key(
        LOOKUP, "with `prompt_lookup_max`, turns on prompt lookup first and the drafter's chain otherwise: a request "
        "whose tokens end in an n-gram of `min` to `max` tokens that occurred earlier gets the tokens that followed "
        "it", "off (a missing bound takes the other's value)", "`min <= max`", ge=1, vllm=True)
    prompt_lookup_max: int | None = _key(
        LOOKUP, "the longest n-gram prompt lookup looks up", "off (a missing bound takes the other's value)",
        "`0` turns off a lookup that `serving.json` recommends", ge=0, vllm=True)
    drafter_tokens: int | None = _key(
        LOOKUP, "the drafter's chain length where lookup finds nothing", "`num_speculative_tokens`",
        "at most `num_speculative_tokens`; only with prompt lookup", ge=1, aliases=("falcon_tokens",))
    lookup_tokens: int | None = _key(
        LOOKUP, "a request's lookup draft length after a lookup draft the target cut short; it doubles after each "
        "lookup draft accepted whole, up to `num_speculative_tokens`", "`num_speculative_tokens` (not adaptive)",
        "at most `num_speculative_tokens`; only with prompt lookup", ge=1)
    drafter_max_batch: int | None = _key(
        LOOKUP, "the drafter's chain serves only steps of at most this many requests; a larger step gets lookup "
        "drafts alone, runs no drafter pass, and its verified rows wait for the next drafter pass", "every step",
        "only with prompt lookup", ge=0, aliases=("falcon_max_batch",))
    datastore: str | bool | None = _key(
        LOOKUP, "a `falcon-vllm datastore` file of the target's answers, looked up where a request's own tokens "
        "repeat nothing; `false` turns off one that `serving.json` recommends",
        "off (the shipped `serving.json` turns it on)",
        "in `serving.json`: relative to the drafter's directory; only with prompt lookup; its token ids must lie "
        "inside the target's vocabulary", kind="path_or_false")
    datastore_tokens: int | None = _key(
        LOOKUP, "the longest datastore draft", "a lookup draft's length", "only with a datastore", ge=1)
    datastore_max_batch: int | None = _key(
        LOOKUP, "the datastore is looked up only in steps of at most this many requests", "every step",
        "only with a datastore", ge=1)

    draft_sample_method: str | None = _key(
        DRAFTS, '`"probabilistic"`: sampled requests get drafts drawn from the drafter\'s distribution, which goes '
        "to vLLM's rejection sampler; greedy requests keep the argmax",
        "vLLM's (`greedy`); the shipped `serving.json` says `probabilistic`", "refused in tree mode",
        kind="choice", choices=("greedy", "probabilistic"), vllm=True)
    draft_temperature_scale: float | None = _key(
        DRAFTS, "sampled drafts are drawn at this times the request's temperature",
        "1 (vLLM's behaviour); the shipped `serving.json` says 0.6",
        'only with `draft_sample_method: "probabilistic"`', kind="number", gt=0, le=16)
    draft_confidence: float | None = _key(
        DRAFTS, "a request's chain stops before its first token where the product of the drafter's probabilities "
        "so far falls below this; a further drafter pass runs only while some request's draft goes on",
        "0 (every token)", "refused in tree mode", kind="number", ge=0, lt=1)
    draft_gemm_dtype: str | None = _key(
        DRAFTS, "the dtype of the drafter's matmuls", "`$FALCON_VLLM_DRAFT_GEMM_DTYPE`, else `auto`",
        "`auto` applies when an fp32 model is served on a CPU: bf16 with AMX, else int8 with VNNI, else bf16 with "
        "AVX512-BF16, else the model's dtype; `int8` and `bfloat16` are for CPU serving, refused on a GPU",
        kind="choice", choices=GEMM_DTYPES)

    def lookup(self, names: dict[str, str]) -> tuple[int, int] | None:
        """The prompt-lookup n-gram bounds (min, max), None when lookup is off; the lookup-only keys' rules."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        given = [names.get(k, k) for k in ("drafter_tokens", "lookup_tokens") if getattr(self, k) is not None]
        if hi == 0 or (lo is None and hi is None):
            if hi == 0 and lo is not None:
                given.insert(0, "prompt_lookup_min")
            if given:
                how = ("(prompt_lookup_max >= 1)" if hi == 0 else "give prompt_lookup_max (the longest n-gram "
                       "looked up), or use num_speculative_tokens for the drafter's chain")
                raise ValueError(f"falcon-vllm: {given[0]} only applies with prompt lookup{'' if hi == 0 else ':'} "
                                 f"{how}")
            return None
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo < 1 or lo > hi:
            raise ValueError(f"falcon-vllm: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        return lo, hi

    def check(self, n: int, tree_mode: bool, names: dict[str, str]) -> tuple[int, int] | None:
        """The rules between keys, for a config of ``n`` speculative tokens (in tree mode or not); returns
        :meth:`lookup`.  ``names``: how the config spelled each key (its aliases)."""
        name = lambda k: names.get(k, k)  # noqa: E731
        lookup = self.lookup(names)
        store = None if self.datastore is False else self.datastore
        for k in ("datastore_tokens", "datastore_max_batch"):
            if getattr(self, k) is not None and store is None:
                raise ValueError(f"falcon-vllm: {k} comes with a datastore: give datastore (a `falcon-vllm "
                                 "datastore` file) too, or drop it")
        if self.drafter_max_batch is not None and lookup is None:
            raise ValueError(f"falcon-vllm: {name('drafter_max_batch')} comes with prompt lookup: give "
                             "prompt_lookup_max too, or drop it")
        if store is not None and lookup is None:
            raise ValueError("falcon-vllm: datastore (a `falcon-vllm datastore` file, or false) is looked up with "
                             "prompt lookup: give prompt_lookup_max too")
        if self.draft_temperature_scale is not None and self.draft_sample_method != "probabilistic":
            raise ValueError("falcon-vllm: draft_temperature_scale (the drafter's temperature over the request's) "
                             "applies to sampled drafts: give draft_sample_method \"probabilistic\" too")
        if not tree_mode:
            check_chain_length(n)
        if (sch := self.num_speculative_tokens_per_batch_size) and max(r[2] for r in sch) > n:
            raise ValueError(f"falcon-vllm: num_speculative_tokens_per_batch_size {sch} drafts more than "
                             f"num_speculative_tokens ({n}) at some batch size: K <= {n} in every row")
        if tree_mode and lookup is not None:
            raise ValueError("falcon-vllm: prompt lookup (prompt_lookup_max) runs in chain mode; give a chain "
                             "(num_speculative_tokens) instead of a tree, or drop prompt_lookup_max")
        if tree_mode and self.draft_sample_method not in (None, "greedy"):
            raise ValueError(f"falcon-vllm: draft_sample_method={self.draft_sample_method!r} runs in chain mode "
                             "(vLLM's rejection sampler reads the drafts' probabilities); tree mode drafts each node "
                             "greedily. Give a chain (num_speculative_tokens) or drop draft_sample_method")
        if tree_mode and self.draft_confidence:
            raise ValueError("falcon-vllm: draft_confidence cuts chain drafts; tree mode verifies its whole tree. "
                             "Give a chain (num_speculative_tokens) or drop draft_confidence")
        for k in ("drafter_tokens", "lookup_tokens"):
            if lookup is not None and (getattr(self, k) or 0) > n:
                raise ValueError(f"falcon-vllm: {name(k)}={getattr(self, k)} is above num_speculative_tokens={n}")
        return lookup


KEYS: dict[str, Key] = {f.name: f.metadata["key"] for f in fields(FalconOptions)}
ALIASES: dict[str, str] = {a: name for name, key in KEYS.items() for a in key.aliases}
LOOKUP_KEYS = ("prompt_lookup_min", "prompt_lookup_max", "drafter_tokens", "lookup_tokens")
STORE_KEYS = ("datastore", "datastore_tokens", "datastore_max_batch")
# what a chain-form serving.json may recommend (vllm.options.with_recommendation applies each of them)
SERVING_KEYS = ("num_speculative_tokens", "num_speculative_tokens_per_batch_size", "draft_sample_method",
                "draft_temperature_scale", *LOOKUP_KEYS, "drafter_max_batch", *STORE_KEYS)


def parse(config: dict, vllm_keys: set[str], source: str | None = None
          ) -> tuple[FalconOptions, dict, dict[str, str]]:
    """A config dict -> (its keys of the schema, the other vLLM keys as given, {key: how it was spelled}).
    Refuses keys neither in the schema nor in ``vllm_keys``, a key given under two names, and values out of
    bounds; ``source``: the file the dict came from (a ``serving.json``), None for the speculative config."""
    where = "" if source is None else f"{source}: "
    ours, rest, names = {}, {}, {}
    for spelled, v in config.items():
        k = spelled.replace("-", "_")
        k = ALIASES.get(k, k)
        if k in ours or k in rest:
            raise ValueError(f"falcon-vllm: {where}{names.get(k, k)} and {spelled} are the same key; give one")
        names[k] = spelled
        if k in KEYS:
            ours[k] = v
        elif k in vllm_keys:
            rest[k] = v
    unknown = sorted(s for k, s in names.items() if k not in KEYS and k not in vllm_keys)
    if unknown:
        raise ValueError(f"falcon-vllm: unknown option(s) {unknown} in {source or 'the speculative config'}; Falcon "
                         f"options: {sorted(k for k, key in KEYS.items() if not key.vllm)}, plus vLLM's: "
                         f"{sorted(vllm_keys)}")
    for k, v in ours.items():
        if v is not None and not KEYS[k].accepts(v):
            raise ValueError(f"falcon-vllm: {where}{names[k]} must be {KEYS[k].expected()}, got {v!r}")
    return FalconOptions(**ours), rest, names


# ---------------------------------------------------------------------- files
BY_CPU = "num_speculative_tokens_per_batch_size_by_cpu"  # serving.json only: {CPU capability: schedule}


@dataclass(frozen=True)
class ServingFile:
    """A drafter's ``serving.json``: a tune-tree file (``tree_file``), or the chain form: the schema's keys
    (``options``, with ``num_speculative_tokens``) plus per-CPU schedules (``by_cpu``)."""
    tree_file: str | None = None
    options: FalconOptions | None = None
    by_cpu: dict = field(default_factory=dict)

    def for_cpu(self, capability: str | None) -> FalconOptions:
        """The chain form's options, with the schedule measured on CPUs of ``capability`` where it has one."""
        if capability in self.by_cpu:
            return replace(self.options, num_speculative_tokens_per_batch_size=self.by_cpu[capability])
        return self.options


def read_serving(path: str) -> ServingFile:
    """Read and check a ``serving.json`` through the schema."""
    data = _load_json(path)
    if isinstance(data, dict) and ("paths" in data or "by_batch_size" in data):
        if data.get("draft_sample_method") not in (None, "greedy"):
            raise ValueError(f"falcon-vllm: {path}: draft_sample_method={data['draft_sample_method']!r} needs a "
                             "chain; a tune-tree file serves a tree, whose nodes are drafted greedily")
        if chain := sorted(k for k in data if k != "draft_sample_method"
                           and ALIASES.get(k.replace("-", "_"), k.replace("-", "_")) in KEYS):
            raise ValueError(f"falcon-vllm: {path}: {chain} belong to the chain form of serving.json; a tune-tree "
                             "file serves its own trees and would ignore them")
        return ServingFile(tree_file=path)
    if not (isinstance(data, dict) and data.get("num_speculative_tokens") is not None):
        raise ValueError(f"falcon-vllm: {path} must be a `falcon-vllm tune-tree` file or "
                         "{\"num_speculative_tokens\": n}")
    data = dict(data)
    by_cpu = data.pop(BY_CPU, None)
    where = f"{path}: "
    not_here = sorted(set(data) & {"method", "model", "tree", "drafter_k", "falcon_k"})
    if not_here:
        raise ValueError(f"falcon-vllm: {where}{not_here} belong in the speculative config, not in serving.json "
                         "(the chain form recommends a chain for the drafter it sits beside)")
    opts, _, names = parse(data, set(), path)
    if ignored := sorted(names[k] for k in names if k not in SERVING_KEYS):
        raise ValueError(f"falcon-vllm: {where}{ignored} cannot be recommended by serving.json (it would have no "
                         f"effect): give them in the speculative config; serving.json takes {list(SERVING_KEYS)}")
    n = opts.num_speculative_tokens
    if by_cpu is not None and not (isinstance(by_cpu, dict) and all(isinstance(c, str) for c in by_cpu)):
        raise ValueError(f"falcon-vllm: {where}{BY_CPU} must map CPU capabilities (e.g. \"AVX512\", as "
                         f"torch.backends.cpu.get_cpu_capability() names them) to schedules, got {by_cpu!r}")
    schedule_key = KEYS["num_speculative_tokens_per_batch_size"]
    for k, sch in [("num_speculative_tokens_per_batch_size", opts.num_speculative_tokens_per_batch_size)] + [
            (f"{BY_CPU}[{c!r}]", v) for c, v in (by_cpu or {}).items()]:
        if sch is not None and not (schedule_key.accepts(sch) and all(r[2] <= n for r in sch)):
            raise ValueError(f"falcon-vllm: {where}{k} must be a list of [min batch size, max batch size, K] "
                             f"with 0 <= K <= num_speculative_tokens ({n}), got {sch!r}")
    if opts.draft_temperature_scale is not None and opts.draft_sample_method != "probabilistic":
        raise ValueError(f"falcon-vllm: {where}draft_temperature_scale applies to sampled drafts "
                         "(draft_sample_method \"probabilistic\")")
    return ServingFile(options=opts, by_cpu=by_cpu or {})


# ---------------------------------------------------------------------- docs
DOC = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
BEGIN, END = ("<!-- the key tables: generated by `python -m falcon_vllm.schema --write`; do not edit -->",
              "<!-- end of the generated key tables -->")


def markdown() -> str:
    """The key tables of docs/serving.md."""
    out = []
    for group in (DRAFTER, LOOKUP, DRAFTS):
        out += [f"### {group}", "", "| key | meaning | default | bounds and rules |", "|---|---|---|---|"]
        for name, key in KEYS.items():
            if key.group == group:
                label = f"`{name}`" + (" (vLLM)" if key.vllm else "")
                label += "".join(f" (old name: `{a}`)" for a in key.aliases)
                out.append(f"| {label} | {key.doc} | {key.default} | {key.bounds() or '-'} |")
        out.append("")
    out += ["### vLLM keys refused with Falcon", "", "| key | why |", "|---|---|"]
    out += [f"| `{k}` (anything but false) | {why} |" for k, _, why in INCOMPATIBLE]
    out += ["", "Every other vLLM `SpeculativeConfig` key passes to vLLM, which validates it. Keys may be written with "
            "`-` or `_`; an old name still works, and giving a key under both names is refused."]
    return "\n".join(out)


def doc_with_tables(text: str) -> str:
    """``text`` (docs/serving.md) with its generated section replaced by :func:`markdown`."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"falcon-vllm: {DOC} lacks the markers of its generated key tables")
    return f"{head}{BEGIN}\n{markdown()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        DOC.write_text(doc_with_tables(DOC.read_text()))
        print(f"wrote the key tables of {DOC}")
    elif argv:
        print("usage: python -m falcon_vllm.schema [--write]", file=sys.stderr)
        return 2
    else:
        print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
