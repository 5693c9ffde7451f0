"""``TrainConfig``, the options of one training run: the single source of the ``falcon-vllm train`` flags.

Each field is declared with ``option(default, help, ...)``, and its flag is made from it: the name
(``--`` and the field's name with dashes, unless ``flag=`` says another), the type (the annotation's
int or float; text otherwise), the choices and the help.  So a new field is a new flag.  Example::

    max_len: int = option(384, "training positions per conversation")   # --max-len MAX_LEN (int, 384)
    bf16: bool = option(False, "bf16 autocast")                          # --bf16 (a switch: True)
    resume: bool = option(True, "start afresh")                          # --no-resume (a switch: False)

``add_config_arguments`` puts the flags on a parser and ``config_from_args`` reads them back into a
``TrainConfig``.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from functools import cache
from typing import Any, Callable

from falcon_vllm.train.gen_data import layer_list


def option(default: Any = MISSING, help: str = "", *, flag: str | None = None, choices: tuple[str, ...] | None = None,
           parse: Callable[[Any], Any] | None = None, flag_default: Any = MISSING) -> Any:
    """A ``TrainConfig`` field with what its flag needs: ``help`` (for a bool field, what giving the switch does:
    a switch flips the default), ``flag`` (its name, when not the field's), ``choices``, ``parse`` (the flag's
    value -> the field's) and ``flag_default`` (the flag's default, when the command line's differs from the
    field's: a text form, or another value)."""
    meta = {"help": help, "flag": flag, "choices": choices, "parse": parse, "flag_default": flag_default}
    return field(metadata=meta) if default is MISSING else field(default=default, metadata=meta)


def none_if_zero(value: int) -> int | None:
    """A count flag's value, where 0 stands for None (no limit)."""
    return value or None


def float_list(text: str) -> tuple[float, ...]:
    """Comma-separated numbers ("1,0.5"; "" for none)."""
    return tuple(float(x) for x in text.split(",") if x.strip())


@dataclass
class TrainConfig:
    """Hyper-parameters and options of one training run (the ``falcon-vllm train`` flags).  Stored whole in
    ``checkpoint.pt`` and, without its paths, as the drafter's training record (``falcon.extra.training``).
    ``data_dir`` and ``target_dir`` may be None when ``train`` is given the samples and the target model."""
    out_dir: str = option(help="output drafter directory (checkpoint.pt for resume)", flag="--out")
    data_dir: str | None = option(None, "gen-data output directory", flag="--data")
    extra_data_dir: str | None = option(
        None, "gen-data directories (comma-separated) trained on after --data's training conversations and never "
        "held out, e.g. the later turns of those conversations (gen-data --loss-from-turn 2); any that begins with "
        "a held-out conversation's prompt is left out", flag="--extra-data")
    target_dir: str | None = option(None, "target HF dir (default: SmolLM2-135M-Instruct)", flag="--target")
    mode: str = option("falcon", "falcon: CSGD; eagle: an EAGLE-1 drafter (k=1, fc fusion, no glancing), also "
                       "exported in the layout of vLLM's built-in EAGLE", choices=("falcon", "eagle"))
    k: int = option(2, "tokens per drafter block")
    fusion: str = option("lstm", "fusion of token embedding and feature", choices=("lstm", "fc"))
    layers: int = option(1, "drafter decoder layers")
    intermediate_size: int | None = option(None, "MLP width of the drafter's decoder layers (default: the target's; "
                                           "narrower keeps a drafter for a wide target small)")
    epochs: int = option(3, "passes over the training conversations")
    batch_size: int = option(8, "conversations per step (per process)")
    lr: float = option(1e-3, "AdamW peak learning rate (5% warm-up, then linear decay)")
    max_len: int = option(384, "training positions per conversation")
    glance: str = option("uniform", "which positions glancing replaces: uniform over every k-th loss position "
                         "(the official code), among the mispredicted ones (error), or none",
                         choices=("uniform", "error", "none"))
    glance_loss: str = option("keep", "keep glanced positions in the loss (the official code) or mask them out",
                              choices=("keep", "mask"))
    lambda_schedule: str = option("code", "glancing ratio over the epochs: the official code's (0.45 -> 0.1) or "
                                  "the paper's (0.4 -> 0)", choices=("code", "paper"))
    noise: str = option("scaled", "input feature noise: scaled U(+-51.2/L) (the official code) or fixed U(+-0.1) "
                        "(the paper)", choices=("scaled", "fixed"))
    w_dist: float = option(0.1, "weight of the token losses (soft + CE) against the feature regression (the "
                           "paper's 0.1)", flag="--token-weight")
    alpha: float = option(0.9, "soft-loss share of the token losses (the rest: CE)")
    tree: str | None = option(None, "default tree recorded in the drafter and used for sim tau")
    max_steps: int | None = option(None, "optimisation steps in all (default: epochs x steps per epoch)")
    seed: int = option(0, "seed of the initial weights, batch order, noise and glancing")
    eval_every_epoch: bool = option(True, "skip the held-out metrics after each epoch (they are always computed at "
                                    "the end)")
    resume: bool = option(True, "start afresh even if --out holds a checkpoint.pt (default: continue from it)")
    save_dtype: str | None = option(None, "dtype of the stored weights (bf16 keeps a 1-layer drafter small enough "
                                    "for git)", choices=("float32", "bfloat16"), flag_default="bfloat16")
    stop_after_epochs: int | None = option(None, "stop after this many epochs (checkpoint.pt resumes the run)")
    stop_after_steps: int | None = option(None, "stop after this many steps in all (checkpoint.pt resumes the run)")
    checkpoint_minutes: float = option(10.0, "also write checkpoint.pt within an epoch every this many minutes, so "
                                       "an interrupted run loses at most that much (one process only; under torchrun "
                                       "at epoch ends; 0: after every step)")
    bf16: bool = option(False, "bf16 autocast, fp32 weights and optimiser, and the teacher cache's product over the "
                        "vocabulary in bf16 (its top-k recomputed in fp32); the recipes turn it on where the device "
                        "computes bf16 natively: a GPU, a CPU with AVX512-BF16 or AMX; on a CPU without, one step "
                        "measured 26x slower than fp32")
    teacher_topk: int = option(64, "cache the frozen teacher's top-k once (soft loss over it); 0 = full teacher "
                               "every step")
    logit_positions: int | None = option(256, "LM-head rows per batch for the token losses and the glance pass "
                                         "(random subset of the loss positions; 0 = all)", parse=none_if_zero)
    max_context: int | None = option(128, "prompt tokens kept before the answer (0 = all)", parse=none_if_zero)
    eval_roots: int = option(240, "held-out tree roots for the final simulated tau")
    draft_vocab: int | None = option(None, "truncated draft head over the N most frequent answer tokens (stored "
                                     "with its d2t map); default: the target's full LM head")
    block_order: str = option("forward", "which block row outputs the next token: forward = the block's first "
                              "(the paper's), reversed = its last, whose input is the newest",
                              choices=("forward", "reversed"))
    level_embedding: bool = option(False, "a learned vector per block row (its offset inside the k-block) added to "
                                   "the fused input")
    block_phase: str = option("fixed", "random: each step trims 0..k-1 of a conversation's last positions, so "
                              "every position trains every block level across epochs; both: every conversation k "
                              "times per step, once per trim, so every position trains every level in every step "
                              "(up to k times the compute); fixed: the same level each epoch",
                              choices=("fixed", "random", "both"))
    max_conversations: int | None = option(None, "train on the first N training conversations only (the held-out "
                                           "set is unchanged)")
    device: str = option("cpu", "cpu or cuda (under torchrun: each rank its LOCAL_RANK GPU)")
    train_draft_head: bool = option(True, "keep a truncated head at the target's LM-head rows, stored as its d2t "
                                    "map alone (the rows are read from the target at load time; default: trained "
                                    "with the drafter, and stored)", flag="--freeze-draft-head")
    init_from: str | None = option(
        None, "start from this trained drafter's weights (same architecture and draft head; a new optimiser and "
        "schedule: e.g. to train a shipped drafter further). With more --layers than it has, the extra layers start "
        "as the identity (zero output projections); an EAGLE-1 drafter (k=1) may seed a Falcon drafter of any --k "
        "and --block-order")
    second_pass: float = option(0.0, "weight of a second loss on the drafter's next pass, fed the features its "
                                "first pass predicted (as tree passes are in serving; EAGLE-3's training-time "
                                "test); 0 = off")
    aux_layers: tuple[int, ...] = option(
        (), "comma-separated target layers whose input states the drafter also reads (EAGLE-3's low/mid/high "
        "features); the data must have been made with the same gen-data --aux-layers", parse=layer_list,
        flag_default="")
    level_weights: tuple[float, ...] = option(
        (), "comma-separated loss weight of each block level, level 1 (the next token) first, k of them (e.g. "
        "1,0.5); default: all 1", parse=float_list, flag_default="")

    def record(self) -> dict:
        """The fields without the machine's paths (the training record ships with the drafter)."""
        return {n: v for n, v in asdict(self).items() if not n.endswith("_dir") and n != "init_from"}


@cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def flag_name(f: Field) -> str:
    """The flag of a ``TrainConfig`` field: ``--max-len`` for ``max_len``, ``--no-resume`` for the bool ``resume``
    (True by default), unless the field names its own."""
    if f.metadata["flag"]:
        return f.metadata["flag"]
    dashed = f.name.replace("_", "-")
    return f"--no-{dashed}" if _hints()[f.name] is bool and f.default is True else f"--{dashed}"


def flag_dest(f: Field) -> str:
    """Where argparse keeps the flag's value (``args.token_weight`` for ``--token-weight``)."""
    return flag_name(f)[2:].replace("-", "_")


def flag_default(f: Field) -> Any:
    """The flag's default: its own where the field declares one, None for a field without a default."""
    if f.metadata["flag_default"] is not MISSING:
        return f.metadata["flag_default"]
    return None if f.default is MISSING else f.default


def _number_type(hint) -> type | None:
    """int or float for a field annotated with one (or with it or None); None (text) otherwise."""
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint if hint in (int, float) else None


def add_config_arguments(p) -> None:
    """One flag per ``TrainConfig`` field, in field order, on the argparse parser ``p``."""
    for f in fields(TrainConfig):
        kw: dict[str, Any] = {"dest": flag_dest(f), "help": f.metadata["help"].replace("%", "%%")}
        if _hints()[f.name] is bool:  # a switch: giving it flips the field's default
            p.add_argument(flag_name(f), action="store_true", **kw)
            continue
        if f.metadata["choices"]:
            kw["choices"] = list(f.metadata["choices"])
        if number := _number_type(_hints()[f.name]):
            kw["type"] = number
        p.add_argument(flag_name(f), default=flag_default(f), **kw)


def config_from_args(args, **values) -> TrainConfig:
    """The ``TrainConfig`` of parsed ``add_config_arguments`` flags; ``values`` replace fields (e.g. a default
    filled in by the command)."""
    for f in fields(TrainConfig):
        if f.name in values:
            continue
        value = getattr(args, flag_dest(f))
        if _hints()[f.name] is bool:
            value = value != f.default
        elif f.metadata["parse"]:
            value = f.metadata["parse"](value)
        values[f.name] = value
    return TrainConfig(**values)
