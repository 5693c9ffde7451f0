"""``falcon-vllm train``'s training loop: Coupled Sequential Glancing Distillation (CSGD) for Falcon drafters.

Per step (FALCON_REFERENCE.md §3.3, any batch size here):

1. inputs: position j reads (x_{j+1}, f_j + noise); labels are f_{j+k} (regression) and the
   target's distribution lm_head(f_{j+k}) over x_{j+k+1}; the relaxed mask has blocks aligned to
   the end of each sequence (``chunk_mask``), exactly as the drafter is run (:mod:`falcon_vllm.train.data`);
2. glance pass (no grad): Hamming distance d between the drafter's and the teacher's argmax
   tokens on the loss positions of each sequence;
3. N = lambda(epoch) * d positions p get the coupled ground truth (f_{p+k}, x_{p+k+1}) as input;
4. gradient pass: loss = SmoothL1(pred, f_{j+k}) + w_dist * (alpha * soft + (1 - alpha) * CE),
   soft = sum p_T log(softmax(t/T) / softmax(s/T)) with T = 0.95 (the official form), CE against
   the teacher's argmax token (steps 2-4: :mod:`falcon_vllm.train.losses`).

Where paper and code disagree each choice is a flag: ``--lambda-schedule code|paper``,
``--glance uniform|error|none`` (uniform over every k-th loss position as in the code, or among
mispredicted positions), ``--glance-loss keep|mask`` (the code keeps glanced positions in the
loss), ``--noise scaled|fixed`` (code: U(+-51.2/L), paper: U(+-0.1)).  ``--mode eagle`` trains an
EAGLE-1 drafter (k=1, fc fusion, no glancing) from the same data, and exports it in the layout of
vLLM's built-in ``method: "eagle"``.  Every option is a field of :class:`falcon_vllm.train.config.TrainConfig`.

Held-out metrics each epoch (:mod:`falcon_vllm.train.evaluation`): per-block-position top-1 accuracy, and
simulated tau of the default tree.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from falcon_vllm.config import FalconConfig
from falcon_vllm.drafter import FalconDrafter
from falcon_vllm.train.config import TrainConfig
from falcon_vllm.train.data import (check_aux, crop_context, data_signature, epoch_batches, frequent_tokens,
                                    make_batch, outside_of, phase_batch, save_whole, split_held_out, to_device,
                                    with_teacher)
from falcon_vllm.train.evaluation import evaluate
from falcon_vllm.train.gen_data import Sample, load_shards
from falcon_vllm.train.losses import (add_noise, apply_glance, forward, glance_positions, lam, level_weights, losses,
                                      second_pass, subsample)
from falcon_vllm.tree import build_tree


def train(cfg: TrainConfig, samples: list[Sample] | None = None, target=None, log=print) -> dict:
    """Train a drafter into ``cfg.out_dir`` (``checkpoint.pt`` each epoch and every ``cfg.checkpoint_minutes``:
    resumable) on the conversations of ``cfg.data_dir``, or on ``samples`` (then no teacher cache is written),
    distilled from ``target`` (default: loaded from ``cfg.target_dir``).  Under ``torchrun`` it runs data-parallel
    (DDP; NCCL on CUDA, gloo on CPU): each rank takes every world-th batch, rank 0 evaluates and writes.  Returns
    {"final", "history", "out", "drafter"} (rank 0; others: "final" None).

    The drafter's attention runs without cuDNN's SDPA kernel, which builds an execution plan for every new
    batch shape: training batches come in as many shapes as there are conversation lengths (H100, bf16:
    0.150 s per step with it, 0.036 s without; ``benchmarks/results/gpu/train_speed_h100_cuda_*.md``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return _train(cfg, samples, target, log)


def _train(cfg: TrainConfig, samples: list[Sample] | None, target, log) -> dict:
    """``train``'s steps: check the options, load the target and the data, build the drafter and its optimiser,
    resume, train the epochs, then (rank 0) evaluate on the held-out set and save."""
    check_config(cfg)
    rank, world, device = init_distributed(cfg.device)
    if cfg.second_pass and world > 1:
        raise ValueError("falcon-vllm: train: --second-pass runs in one process only (not yet under torchrun)")
    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    rng = random.Random(cfg.seed + rank)
    gen = torch.Generator().manual_seed(cfg.seed + rank)
    target = load_target(cfg, target, device)
    cfg = as_trained(cfg)
    train_set, val_set, counts = training_data(cfg, samples, target, log)
    drafter, init_record = build_drafter(cfg, target, train_set, device)
    net = drafter
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(drafter, device_ids=[torch.device(device).index] if device.startswith("cuda")
                                      else None)
    opt, sched, steps_per_epoch, total = optimiser(drafter, cfg, len(train_set), world)
    run = Run(cfg, rank, world, device, train_set=train_set, val_set=val_set, drafter=drafter, net=net, opt=opt,
              sched=sched, steps_per_epoch=steps_per_epoch, total=total, rng=rng, gen=gen)
    os.makedirs(cfg.out_dir, exist_ok=True)
    if cfg.resume and os.path.exists(run.checkpoint):
        resume(run, log)
    tree_obj = build_tree(cfg.tree, cfg.k)
    t0 = time.time()
    drafter.train()
    if not run_epochs(run, tree_obj, t0, log):
        return {"stopped": True, "state": run.state, "out": cfg.out_dir}  # resume later from checkpoint.pt
    if rank > 0:
        torch.distributed.barrier()  # rank 0 evaluates and writes the drafter
        return {"final": None, "history": run.state["history"], "out": cfg.out_dir, "drafter": drafter}
    final = evaluate(drafter, val_set, tree_obj, cfg.k, cfg.max_len, cfg.eval_roots)
    final.update(steps=run.state["step"], seconds=round(time.time() - t0, 1), train_conversations=len(train_set),
                 **counts, processes=world, device=str(torch.device(device).type))
    save_drafter(run, final, init_record)
    return {"final": final, "history": run.state["history"], "out": cfg.out_dir, "drafter": drafter}


def check_config(cfg: TrainConfig) -> None:
    """Refuse options that cannot train (before anything is loaded)."""
    if cfg.block_phase not in ("fixed", "random", "both"):
        raise ValueError("falcon-vllm: train: block_phase must be 'fixed', 'random' or 'both', not "
                         f"{cfg.block_phase!r}")
    if not cfg.w_dist >= 0:
        raise ValueError(f"falcon-vllm: train: the token-loss weight must be >= 0, not {cfg.w_dist!r}")
    if cfg.level_weights and (len(cfg.level_weights) != cfg.k or min(cfg.level_weights) < 0
                              or max(cfg.level_weights) <= 0):
        raise ValueError(f"falcon-vllm: train: --level-weights takes k = {cfg.k} weights >= 0, not all 0 (level 1 "
                         f"first), got {list(cfg.level_weights)}")
    if cfg.second_pass < 0:
        raise ValueError(f"falcon-vllm: train: the second-pass loss weight must be >= 0, not {cfg.second_pass!r}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("falcon-vllm: train: --device cuda but torch sees no CUDA device")


def load_target(cfg: TrainConfig, target, device: str):
    """The frozen target on ``device``: ``target``, or the model in ``cfg.target_dir`` (fp32)."""
    if target is None:
        from transformers import AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained(cfg.target_dir, dtype=torch.float32).eval()
    return target.to(device)


def as_trained(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` as it trains: EAGLE-1's own choices under ``mode="eagle"``, and the default tree of its k."""
    if cfg.mode == "eagle":  # EAGLE-1: one token per block, fc fusion, no glancing
        cfg = replace(cfg, k=1, fusion="fc", glance="none")
    if cfg.tree is None:
        cfg = replace(cfg, tree={2: "falcon-llama", 1: "eagle-small"}.get(cfg.k, f"chain-{2 * cfg.k}"))
    return cfg


def training_data(cfg: TrainConfig, samples: list[Sample] | None, target, log) -> tuple[list, list, dict]:
    """(training conversations, held-out conversations, counts for the final record): those of ``cfg.data_dir``
    (or ``samples``) with their cached teacher, split (``split_held_out``), ``cfg.extra_data_dir``'s added to the
    training side, prompts cropped to ``cfg.max_context``."""
    data_dir = cfg.data_dir if samples is None else None  # where the teacher cache is kept (none for samples)
    data = load_shards(cfg.data_dir, aux=bool(cfg.aux_layers)) if samples is None else samples
    if not cfg.aux_layers:  # a drafter without aux layers reads the final-norm states alone
        data = [s.without_aux() for s in data]
    check_aux(cfg.aux_layers, data, target.config.hidden_size, data_dir)
    if cfg.teacher_topk:  # the frozen teacher once, not every step (cached next to the data when on disk)
        data = with_teacher(data_dir, data, target.get_output_embeddings(), cfg.teacher_topk, log, cfg.bf16)
    train_set, val_set, val_left_out = split_held_out(data)  # before cropping: whole prompts compared
    log(f"held out: {len(val_set)} conversations ({val_left_out} more left out: a training conversation has "
        "their prompt)")
    extra, left_out = extra_data(cfg, val_set, target, log) if cfg.extra_data_dir else ([], 0)
    if cfg.max_context is not None:
        train_set, val_set, extra = ([crop_context(s, cfg.max_context) for s in part]
                                     for part in (train_set, val_set, extra))
    if cfg.max_conversations:  # data-size ablations: fewer training conversations, the same held-out ones
        train_set = train_set[:cfg.max_conversations]
    counts = {"extra_conversations": len(extra), "extra_left_out": left_out, "heldout_conversations": len(val_set),
              "heldout_left_out": val_left_out}
    return train_set + extra, val_set, counts


def extra_data(cfg: TrainConfig, val_set: list, target, log) -> tuple[list, int]:
    """The training-only conversations of ``cfg.extra_data_dir`` that have answer tokens, less any that begins
    like a held-out one, and how many were left out so."""
    extra = load_shards(cfg.extra_data_dir, aux=bool(cfg.aux_layers))
    check_aux(cfg.aux_layers, extra, target.config.hidden_size, cfg.extra_data_dir)
    if cfg.teacher_topk:
        extra = with_teacher(cfg.extra_data_dir, extra, target.get_output_embeddings(), cfg.teacher_topk, log,
                             cfg.bf16)
    kept = outside_of(extra, val_set)
    left_out, extra = len(extra) - len(kept), [s for s in kept if s.loss_mask.any()]
    log(f"extra training data: {len(extra)} conversations with answer tokens, "
        f"{sum(int(s.loss_mask.sum()) for s in extra)} answer tokens; {left_out} left out as they begin "
        "like a held-out conversation")
    return extra, left_out


def build_drafter(cfg: TrainConfig, target, train_set: list, device: str) -> tuple[FalconDrafter, dict | None]:
    """The drafter to train, on ``device``, attached to the frozen ``target``: new (a truncated head starts at the
    target's rows of the training set's most frequent answer tokens) or continuing ``cfg.init_from``; and the
    provenance ``init_weights`` records (None for a new drafter)."""
    dcfg = FalconConfig.from_target(target.config, k=cfg.k, fusion=cfg.fusion, num_layers=cfg.layers, tree=cfg.tree,
                                    draft_vocab_size=cfg.draft_vocab, block_order=cfg.block_order,
                                    level_embedding=cfg.level_embedding, aux_layers=tuple(cfg.aux_layers),
                                    intermediate_size=cfg.intermediate_size or target.config.intermediate_size)
    # a head kept at the target's rows is not stored: only its d2t map (the rows are the target's at load time)
    dcfg.frozen_head = bool(dcfg.draft_vocab_size and not cfg.train_draft_head)
    drafter = FalconDrafter(dcfg).to(device)
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    init_record = None
    if cfg.init_from:  # continue a trained drafter (its head and d2t map included) with a fresh schedule
        init_record = init_weights(drafter, cfg.init_from, target.config)
        drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())  # frozen rows: its d2t
    elif dcfg.draft_vocab_size:  # truncated head: the most frequent answer tokens, from the target's rows
        drafter.init_draft_head(frequent_tokens(train_set, dcfg.draft_vocab_size, dcfg.vocab_size),
                                target.get_output_embeddings().weight)
    for p in target.parameters():
        p.requires_grad_(False)
    if dcfg.draft_vocab_size and not cfg.train_draft_head:  # keep the target's rows
        drafter.lm_head.weight.requires_grad_(False)
    return drafter, init_record


def optimiser(drafter: FalconDrafter, cfg: TrainConfig, n_train: int, world: int):
    """(AdamW, its schedule: 5% linear warm-up then linear decay to 0, steps per epoch, steps in all)."""
    if n_train < world:  # an epoch without a batch would never advance the step count
        raise ValueError(f"falcon-vllm: train: {n_train} training conversations for {world} process(es): give more "
                         "data (gen-data --num-conversations)")
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.01)
    steps_per_epoch = max(1, math.ceil(n_train / cfg.batch_size) // world)
    total = cfg.max_steps or steps_per_epoch * cfg.epochs
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * max(0.0, 1 - s / total))
    return opt, sched, steps_per_epoch, total


@dataclass
class Run:
    """One training process at work: its config and place (rank of world, device), the data, the drafter (``net``:
    it or its DDP wrapper) and optimiser, the step counts, its random streams and the progress ``state``
    (``checkpoint.pt`` keeps it: {"step", "epoch", "history": held-out metrics of each epoch})."""
    cfg: TrainConfig
    rank: int
    world: int
    device: str
    train_set: list
    val_set: list
    drafter: FalconDrafter
    net: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    steps_per_epoch: int
    total: int
    rng: random.Random
    gen: torch.Generator
    state: dict = field(default_factory=lambda: {"step": 0, "epoch": 0, "history": []})
    saved_at: float = field(default_factory=time.time)  # when checkpoint.pt was last written (or the run began)
    saved_step: int = 0  # the step it was written at
    seconds: float = 0.0  # the run's seconds (every process it ran in) up to that checkpoint
    timed_steps: int = 0  # and the steps they made: checkpoint.pt keeps both (a stage's time left: recipe --status)

    @property
    def checkpoint(self) -> str:
        return os.path.join(self.cfg.out_dir, "checkpoint.pt")

    @property
    def rng_file(self) -> str:
        """Each rank's random streams (rank 0's are also in ``checkpoint.pt``)."""
        return os.path.join(self.cfg.out_dir, f"rng_rank{self.rank}.pt")


# TrainConfig fields a resumed run may change: where things are, how the run is kept, where and in which precision
# its steps compute (a run moved to another machine), and its length (a run continued for more epochs), not what
# it trains
RESUME_MAY_CHANGE = ("out_dir", "data_dir", "extra_data_dir", "target_dir", "init_from", "device", "bf16",
                     "resume", "eval_every_epoch", "eval_roots", "save_dtype", "stop_after_epochs", "stop_after_steps",
                     "checkpoint_minutes", "epochs", "max_steps")


def resume(run: Run, log) -> None:
    """Continue from ``checkpoint.pt``: weights, optimiser, schedule, progress and random streams; a checkpoint of
    a run with other training settings (another architecture, learning rate, epochs, ...) is refused."""
    try:
        c = torch.load(run.checkpoint, weights_only=False, map_location=run.device)
    except Exception as e:
        raise ValueError(f"falcon-vllm: train: {run.checkpoint} cannot be read ({type(e).__name__}: {e}); delete it "
                         "or give --no-resume to start afresh") from None
    if c.get("world", 1) != run.world:
        raise ValueError(f"falcon-vllm: train: {run.checkpoint} was written by {c.get('world', 1)} processes; resume "
                         f"it with as many (this run has {run.world})")
    now = asdict(run.cfg)
    if differ := [f"{k} {v!r} -> {now[k]!r}" for k, v in c.get("config", {}).items()
                  if k in now and k not in RESUME_MAY_CHANGE and v != now[k]]:
        raise ValueError(f"falcon-vllm: train: {run.checkpoint} is a run with other settings ({'; '.join(differ)}); "
                         "give the same ones to resume it, or --no-resume (or another --out) to start afresh")
    was, now = c.get("data"), data_signature(run.train_set, run.val_set)  # (None: written before it was kept)
    if differ := [f"{k}: {was[k][0]} conversations, {was[k][1]} tokens -> {now[k][0]}, {now[k][1]}" for k in was or {}
                  if was[k] != now.get(k)]:
        raise ValueError(f"falcon-vllm: train: {run.checkpoint} is a run on other data ({'; '.join(differ)}); give "
                         "it the data it began with to resume it, or --no-resume (or another --out) to start afresh")
    run.drafter.load_state_dict(c["model"])
    run.opt.load_state_dict(c["opt"])
    run.sched.load_state_dict(c["sched"])
    run.state = c["state"]
    r = torch.load(run.rng_file, weights_only=False) if os.path.exists(run.rng_file) else c
    run.rng.setstate(r["rng_py"])
    run.gen.set_state(r["rng_gen"])
    torch.set_rng_state(r["rng_torch"])
    run.seconds, run.timed_steps = c.get("seconds", 0.0), c.get("timed_steps", 0)
    run.saved_at, run.saved_step = time.time(), run.state["step"]
    log(f"resumed at step {run.state['step']}")


def run_epochs(run: Run, tree_obj, t0: float, log) -> bool:
    """Train until the last step (True), or until ``cfg.stop_after_epochs`` epochs or ``cfg.stop_after_steps``
    steps are done (False: ``checkpoint.pt`` holds the run)."""
    from tqdm import tqdm

    cfg, state = run.cfg, run.state
    bar = tqdm(total=run.total, initial=state["step"], desc=f"train {cfg.mode}", unit="step", disable=run.rank > 0)
    while state["step"] < run.total:
        if ((cfg.stop_after_epochs is not None and state["epoch"] >= cfg.stop_after_epochs)
                or (cfg.stop_after_steps is not None and state["step"] >= cfg.stop_after_steps)):
            bar.close()
            return False
        ended = train_epoch(run, bar)
        if ended == "stop":
            bar.close()
            return False
        if ended == "epoch":
            end_epoch(run, tree_obj, t0, log)
    bar.close()
    return True


def train_epoch(run: Run, bar) -> str:
    """The steps of the current epoch from where the run stands.  Returns "epoch" when it ran to the epoch's end,
    "last" when the run's last step came first, "stop" at ``cfg.stop_after_steps`` (checkpoint written).  Within the
    epoch ``checkpoint.pt`` is also written every ``cfg.checkpoint_minutes`` (one process only), so an interrupted
    run loses at most that much."""
    cfg, state = run.cfg, run.state
    epoch = state["epoch"]
    batches = epoch_batches(run.train_set, cfg.batch_size, cfg.seed + epoch)[run.rank::run.world][:run.steps_per_epoch]
    for bi in range(state["step"] % run.steps_per_epoch, len(batches)):
        if state["step"] >= run.total:
            return "last"
        step_samples, trim = phase_batch([run.train_set[j] for j in batches[bi]], cfg, run.rng)
        batch = to_device(make_batch(step_samples, cfg.k, cfg.max_len, trim), run.device)
        out = train_step(run.drafter, run.net, run.opt, run.sched, batch, epoch, cfg, run.rng, run.gen)
        state["step"] += 1
        bar.update(1)
        bar.set_postfix(loss=f"{out['loss']:.3f}", acc=f"{out['acc']:.2f}")
        if bi + 1 == len(batches):
            break  # the epoch's last step: end_epoch writes the checkpoint (a resumed run starts the next epoch)
        if cfg.stop_after_steps is not None and state["step"] >= cfg.stop_after_steps:
            save_checkpoint(run)
            return "stop"
        if run.world == 1 and time.time() - run.saved_at >= 60 * cfg.checkpoint_minutes:
            save_checkpoint(run)
    return "epoch"


def end_epoch(run: Run, tree_obj, t0: float, log) -> None:
    """After an epoch: rank 0 adds its held-out metrics to the history (``cfg.eval_every_epoch``), then the
    checkpoint is written."""
    cfg, state = run.cfg, run.state
    state["epoch"] += 1
    if run.rank == 0 and cfg.eval_every_epoch:
        ev = evaluate(run.drafter, run.val_set, tree_obj, cfg.k, cfg.max_len, max(12, cfg.eval_roots // 5))
        ev.update(epoch=state["epoch"], step=state["step"], seconds=round(time.time() - t0, 1))
        state["history"].append(ev)
        log(f"epoch {state['epoch']}: {json.dumps(ev)}")
    save_checkpoint(run)


def save_checkpoint(run: Run) -> None:
    """Rank 0 writes ``checkpoint.pt`` (weights, optimiser, schedule, progress, its random streams) atomically; under
    torchrun every rank keeps its random streams and waits for the others."""
    run.seconds += time.time() - run.saved_at
    run.timed_steps += run.state["step"] - run.saved_step
    if run.rank == 0:
        save_whole({"model": run.drafter.state_dict(), "opt": run.opt.state_dict(), "sched": run.sched.state_dict(),
                    "state": run.state, "world": run.world, "total": run.total, "config": asdict(run.cfg),
                    "data": data_signature(run.train_set, run.val_set),
                    "seconds": round(run.seconds, 1), "timed_steps": run.timed_steps,
                    **random_state(run.rng, run.gen)}, run.checkpoint)
    if run.world > 1:
        torch.save(random_state(run.rng, run.gen), run.rng_file)
        torch.distributed.barrier()
    run.saved_at, run.saved_step = time.time(), run.state["step"]


def save_drafter(run: Run, final: dict, init_record: dict | None) -> None:
    """Write the trained drafter into ``cfg.out_dir`` with its training record (and, for ``mode="eagle"``, vLLM's
    EAGLE layout into ``vllm-eagle/``)."""
    cfg, drafter = run.cfg, run.drafter
    dcfg = drafter.config
    # the training record (draft_vocab as the drafter has it: None when it is the whole vocabulary)
    dcfg.extra = {"training": {**cfg.record(), "draft_vocab": dcfg.draft_vocab_size, "steps": run.state["step"],
                               "heldout": final}}
    if init_record is not None:  # the run it continued (its own record, chained)
        dcfg.extra["training"]["init_from"] = init_record
    drafter.eval()
    save_dtype = getattr(torch, cfg.save_dtype) if cfg.save_dtype else None
    drafter.save_pretrained(cfg.out_dir, dtype=save_dtype)
    if cfg.mode == "eagle":
        export_vllm_eagle(drafter, os.path.join(cfg.out_dir, "vllm-eagle"), dtype=save_dtype)
    if run.world > 1:
        torch.distributed.barrier()


def random_state(rng: random.Random, gen: torch.Generator) -> dict:
    """This process's random streams (kept with the checkpoint: a resumed run draws what it would have)."""
    return {"rng_py": rng.getstate(), "rng_gen": gen.get_state(), "rng_torch": torch.get_rng_state()}


def train_step(drafter, net, opt, sched, batch: dict, epoch: int, cfg: TrainConfig, rng: random.Random,
               gen: torch.Generator) -> dict:
    """One optimisation step on a device batch (``make_batch``): noise on the input features, the glance pass
    (no grad: the drafter's tokens against the teacher's), glancing, the gradient pass through ``net`` (the
    drafter or its DDP wrapper), the losses, the clipped AdamW and schedule step.
    Returns {"loss", "reg", "soft", "ce", "acc"} (floats)."""
    feats = add_noise(batch["feat_in"], batch["lengths"], cfg.noise, gen)
    ids = batch["ids_in"]
    loss_mask = batch["loss"]
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        if cfg.glance != "none":
            # token argmaxes on (a random subset of) the loss positions: the LM head dominates
            obs = subsample(loss_mask, cfg.logit_positions, gen)
            with torch.no_grad():
                pred0 = forward(drafter, ids, feats, batch)
                p_ids = torch.full_like(ids, -1)
                t_ids = torch.full_like(ids, -2)
                p_ids[obs] = drafter.topk_tokens(pred0[obs], 1)[:, 0]
                t_ids[obs] = (batch["t_arg"][obs] if "t_arg" in batch
                              else drafter.target_logits(batch["feat_lbl"][obs]).argmax(-1))
            pos = glance_positions(p_ids, t_ids, loss_mask, cfg.k, lam(epoch, cfg.epochs, cfg.lambda_schedule),
                                   cfg.glance, rng, observed=obs)
            ids, feats = apply_glance({**batch, "ids_in": ids, "feat_in": feats}, pos)
            if cfg.glance_loss == "mask":
                loss_mask = loss_mask.clone()
                for b, p in enumerate(pos):
                    loss_mask[b, p] = False
        pred, kv = forward(drafter, ids, feats, batch, net, with_kv=True)
        tok_mask = subsample(loss_mask, cfg.logit_positions, gen)
        lw = level_weights(batch, cfg.k, cfg.level_weights)
        loss, parts = losses(drafter, pred, batch, loss_mask, cfg.w_dist, cfg.alpha, token_mask=tok_mask, weights=lw)
        if cfg.second_pass:
            pred2, rows = second_pass(drafter, ids, pred, kv, batch, cfg.k, net)
            mask2 = batch["loss"] & rows
            loss2, parts2 = losses(drafter, pred2, batch, mask2, cfg.w_dist, cfg.alpha,
                                   token_mask=subsample(mask2, cfg.logit_positions, gen), weights=lw)
            loss = loss + cfg.second_pass * loss2
            parts["acc2"] = parts2["acc"]
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_value_(drafter.parameters(), 0.5)
    opt.step()
    sched.step()
    return {"loss": float(loss.detach()), **parts}


INIT_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
               "head_dim", "num_layers", "k", "fusion", "fc_bias", "block_order", "draft_vocab_size", "aux_layers",
               "level_embedding", "frozen_head")


def init_weights(drafter: FalconDrafter, directory: str, target_config) -> dict:
    """Load the weights of a trained drafter (Falcon format, or vLLM's EAGLE layout) into ``drafter``,
    whose architecture must be the same, head and ``d2t`` map included, except that ``drafter`` may have
    more decoder layers: the source's layers fill the first ones and each extra layer starts as the
    identity (its attention and MLP output projections zero), so the grown drafter first predicts exactly
    what the source did.  A k=1 source (an EAGLE-1 drafter) may also seed a drafter of any k and block order:
    no weight depends on either, and in the ``reversed`` order the block's last row, whose prediction is the
    next token, reads what EAGLE's single row reads.  Returns the provenance kept in the new drafter's
    training record: {"drafter": name, "training": the old drafter's own record[, "grown_layers": the new
    layers][, "k_from": 1]}."""
    src = FalconDrafter.load(directory, target_config)
    n_src, n_run = src.config.num_layers, drafter.config.num_layers
    seeds_k = src.config.k == 1 and drafter.config.k > 1
    free = {"num_layers"} if n_src < n_run else set()
    free |= {"k", "block_order"} if seeds_k else set()
    free |= {"level_embedding"} if not src.config.level_embedding else set()  # it starts at zero: the same drafter
    diff = [f"{n} {getattr(src.config, n)!r} (run: {getattr(drafter.config, n)!r})" for n in INIT_FIELDS
            if getattr(src.config, n) != getattr(drafter.config, n) and n not in free]
    if diff:
        raise ValueError(f"falcon-vllm: train: --init-from {directory} is another architecture than this run's "
                         "(only more decoder layers may differ, and k and the block order from a k=1 source): "
                         + ", ".join(diff))
    drafter.load_state_dict({**drafter.state_dict(), **src.state_dict()})
    with torch.no_grad():
        for layer in drafter.layers[n_src:]:  # residual branches that write nothing: the identity
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    record = {"drafter": os.path.basename(os.path.normpath(directory)), "training": src.config.extra.get("training")}
    if n_src < n_run:
        record["grown_layers"] = list(range(n_src, n_run))
    if seeds_k:
        record["k_from"] = 1
    return record


def init_distributed(device: str) -> tuple[int, int, str]:
    """(rank, world size, this rank's device): torchrun's environment -> a process group (NCCL on CUDA,
    gloo on CPU); a plain run is rank 0 of 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def export_vllm_eagle(drafter: FalconDrafter, out: str, dtype: torch.dtype | None = None) -> None:
    """Export a k=1 fc drafter in the layout of vLLM's built-in EAGLE-1 (EagleLlamaForCausalLM)."""
    from safetensors.torch import save_file

    cfg = drafter.config
    if cfg.k != 1 or cfg.fusion != "fc" or cfg.fc_bias:
        raise ValueError("falcon-vllm: only k=1 fc drafters without fc bias have vLLM's EAGLE layout")
    d = cfg.to_hf_dict()
    d.pop("falcon")
    # a truncated head needs the plugin's EAGLE-1 class (vLLM's own reads no d2t map)
    d["architectures"] = ["EagleD2TLlamaForCausalLM" if cfg.draft_vocab_size else "LlamaForCausalLM"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    save_file({n: t.detach().to(dtype if dtype and t.is_floating_point() else t.dtype).contiguous()
               for n, t in drafter.state_dict().items() if not (cfg.frozen_head and n == "lm_head.weight")},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
