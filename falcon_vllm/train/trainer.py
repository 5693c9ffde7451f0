"""``falcon-vllm train``: Coupled Sequential Glancing Distillation (CSGD) for Falcon drafters.

Per step (FALCON_REFERENCE.md §3.3, any batch size here):

1. inputs: position j reads (x_{j+1}, f_j + noise); labels are f_{j+k} (regression) and the
   target's distribution lm_head(f_{j+k}) over x_{j+k+1}; the relaxed mask has blocks aligned to
   the end of each sequence (``chunk_mask``), exactly as the drafter is run;
2. glance pass (no grad): Hamming distance d between the drafter's and the teacher's argmax
   tokens on the loss positions of each sequence;
3. N = lambda(epoch) * d positions p get the coupled ground truth (f_{p+k}, x_{p+k+1}) as input;
4. gradient pass: loss = SmoothL1(pred, f_{j+k}) + w_dist * (alpha * soft + (1 - alpha) * CE),
   soft = sum p_T log(softmax(t/T) / softmax(s/T)) with T = 0.95 (the official form), CE against
   the teacher's argmax token.

Where paper and code disagree each choice is a flag: ``--lambda-schedule code|paper``,
``--glance uniform|error|none`` (uniform over every k-th loss position as in the code, or among
mispredicted positions), ``--glance-loss keep|mask`` (the code keeps glanced positions in the
loss), ``--noise scaled|fixed`` (code: U(+-51.2/L), paper: U(+-0.1)).  ``--mode eagle`` trains an
EAGLE-1 drafter (k=1, fc fusion, no glancing) from the same data, and exports it in the layout of
vLLM's built-in ``method: "eagle"``.

Held-out metrics each epoch: per-block-position top-1 accuracy, and simulated tau of the default
tree (the longest tree path matching the target's greedy continuation, drafted exactly as in
serving from true features; see :mod:`falcon_vllm.tune_tree`).
"""

from __future__ import annotations

import json
import math
import os
import random
import time

import torch
import torch.nn.functional as F

from falcon_vllm.config import FalconConfig
from falcon_vllm.drafter import FalconDrafter, chunk_mask
from falcon_vllm.tree import build_tree


# ---------------------------------------------------------------------- batches
def make_batch(samples, k: int, max_len: int):
    """Right-padded batch: tokens, features, loss positions, masks.

    Returns dict with ids_in [B,T] (x_{j+1}), feat_in [B,T,H] (f_j), feat_lbl [B,T,H] (f_{j+k}),
    lbl_ids [B,T] (x_{j+k+1}), loss [B,T] bool, attn [B,T,T] bool, lengths [B].
    """
    B = len(samples)
    lens = [min(len(s[0]) - k - 1, max_len) for s in samples]
    T = max(lens)
    H = samples[0][2].shape[1]
    ids_in = torch.zeros(B, T, dtype=torch.long)
    lbl_ids = torch.zeros(B, T, dtype=torch.long)
    feat_in = torch.zeros(B, T, H)
    feat_lbl = torch.zeros(B, T, H)
    loss = torch.zeros(B, T, dtype=torch.bool)
    attn = torch.eye(T, dtype=torch.bool).expand(B, T, T).clone()  # padded rows see themselves
    for b, ((tok, mask, hid), L) in enumerate(zip(samples, lens)):
        ids_in[b, :L] = tok[1:L + 1]
        lbl_ids[b, :L] = tok[k + 1:L + k + 1]
        feat_in[b, :L] = hid[:L].float()
        feat_lbl[b, :L] = hid[k:L + k].float()
        loss[b, :L] = mask[k + 1:L + k + 1]  # train where the predicted token is an answer token
        attn[b, :L, :L] = chunk_mask(0, L, k)
    return {"ids_in": ids_in, "feat_in": feat_in, "feat_lbl": feat_lbl, "lbl_ids": lbl_ids, "loss": loss,
            "attn": attn, "lengths": torch.tensor(lens)}


def lam(epoch: int, epochs: int, schedule: str) -> float:
    if schedule == "paper":  # 0.4 (ep_t - ep_c) / ep_t
        return 0.4 * (epochs - epoch) / epochs
    return 0.35 * (epochs - epoch) / epochs + 0.1  # the official code (20 -> epochs)


def glance_positions(pred_ids, teacher_ids, loss, k: int, lam_value: float, mode: str, gen: random.Random):
    """Choose positions to replace per sequence.  Returns list of LongTensors (one per sample)."""
    out = []
    for b in range(pred_ids.shape[0]):
        m = loss[b].nonzero().flatten()
        if m.numel() < 2 or mode == "none":
            out.append(torch.zeros(0, dtype=torch.long))
            continue
        wrong = pred_ids[b, m] != teacher_ids[b, m]
        n = int(lam_value * int(wrong.sum()))
        cand = m[::k] if mode == "uniform" else m[wrong]
        n = min(n, cand.numel())
        out.append(cand[sorted(gen.sample(range(cand.numel()), n))] if n else torch.zeros(0, dtype=torch.long))
    return out


def apply_glance(batch, positions):
    """Replace input (f_p, x_{p+1}) by the coupled ground truth (f_{p+k}, x_{p+k+1}) at each p."""
    ids, feats = batch["ids_in"].clone(), batch["feat_in"].clone()
    for b, pos in enumerate(positions):
        if pos.numel():
            ids[b, pos] = batch["lbl_ids"][b, pos]
            feats[b, pos] = batch["feat_lbl"][b, pos]
    return ids, feats


def add_noise(feats, lengths, mode: str, gen: torch.Generator):
    u = torch.rand(feats.shape, generator=gen) - 0.5
    if mode == "fixed":
        return feats + 0.2 * u  # U(-0.1, 0.1)
    scale = (0.2 * 512 / lengths.clamp(min=1).float())[:, None, None]  # official: U(+-51.2/L)
    return feats + u * scale


def losses(drafter, pred, batch, loss_mask, w_dist: float, alpha: float, T: float = 0.95):
    """SmoothL1 on features + w_dist * (alpha * soft + (1 - alpha) * CE); logits on loss positions only."""
    sel = loss_mask
    n = sel.sum().clamp(min=1)
    p_sel, t_sel = pred[sel], batch["feat_lbl"][sel]
    reg = F.smooth_l1_loss(p_sel.float(), t_sel, reduction="none").mean(-1).sum() / n
    s_logits = drafter.logits(p_sel).float()
    with torch.no_grad():
        t_logits = drafter.logits(t_sel).float()
        p_t = t_logits.softmax(-1)
        teacher = t_logits.argmax(-1)
    soft = (p_t * (torch.log_softmax(t_logits / T, -1) - torch.log_softmax(s_logits / T, -1))).sum(-1).sum() / n
    ce = F.cross_entropy(s_logits, teacher, reduction="sum") / n
    acc = (s_logits.argmax(-1) == teacher).float().mean()
    return reg + w_dist * (alpha * soft + (1 - alpha) * ce), {"reg": float(reg), "soft": float(soft),
                                                               "ce": float(ce), "acc": float(acc)}


def forward(drafter, ids, feats, batch):
    B, T = ids.shape
    pos = torch.arange(T).expand(B, T)
    out, _ = drafter(drafter.embed(ids), feats, pos, batch["attn"])
    return out


# ---------------------------------------------------------------------- evaluation
@torch.inference_mode()
def evaluate(drafter, samples, tree, k: int, max_len: int, max_roots: int = 120):
    """Held-out per-block-position top-1 accuracy and simulated tau of ``tree``."""
    from falcon_vllm.tune_tree import rank_profile

    drafter.eval()
    correct = torch.zeros(k)
    total = torch.zeros(k)
    for s in samples:
        b = make_batch([s], k, max_len)
        pred = forward(drafter, b["ids_in"], b["feat_in"], b)[0]
        L = int(b["lengths"][0])
        sel = b["loss"][0, :L]
        hit = drafter.logits(pred[:L]).argmax(-1) == drafter.logits(b["feat_lbl"][0, :L]).argmax(-1)
        r = (torch.arange(L) - (L - k)) % k  # offset inside its (end-aligned) block
        for o in range(k):
            m = sel & (r == o)
            correct[o] += (hit & m).sum()
            total[o] += m.sum()
    nodes = set(tree.nodes)
    accepted, roots = [], 0
    topk = max(tree.topk, 1)
    for tok, mask, hid in samples:
        start = int(mask.nonzero()[0]) if mask.any() else len(tok)
        rs = list(range(max(start, k), len(tok) - tree.max_depth - 1, 3))
        if not rs or roots >= max_roots:
            continue
        rs = rs[: max_roots - roots]
        roots += len(rs)
        for prof in rank_profile(drafter, tok, hid.float(), tree.max_depth, topk, rs):
            a = 0
            while a < len(prof) and tuple(prof[:a + 1]) in nodes:
                a += 1
            accepted.append(a)
    drafter.train()
    acc = (correct / total.clamp(min=1)).tolist()
    return {"top1_by_block_position": [round(x, 4) for x in acc],
            "sim_tau": round(1 + sum(accepted) / max(1, len(accepted)), 4), "sim_roots": len(accepted)}


# ---------------------------------------------------------------------- training loop
def train(data_dir: str, out_dir: str, target=None, target_dir: str | None = None, mode: str = "falcon", k: int = 2,
          fusion: str = "lstm", layers: int = 1, epochs: int = 3, batch_size: int = 8, lr: float = 1e-3,
          max_len: int = 384, glance: str = "uniform", glance_loss: str = "keep", lambda_schedule: str = "code",
          noise: str = "scaled", w_dist: float = 0.1, alpha: float = 0.9, tree: str | None = None,
          max_steps: int | None = None, seed: int = 0, eval_every_epoch: bool = True, resume: bool = True,
          save_dtype: torch.dtype | None = None, stop_after_epochs: int | None = None, bf16: bool = False,
          log=print) -> dict:
    from tqdm import tqdm

    from falcon_vllm.train.gen_data import load_shards

    torch.manual_seed(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if target is None:
        from transformers import AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    if mode == "eagle":
        k, fusion, glance = 1, "fc", "none"
    tree = tree or ("falcon-llama" if k == 2 else ("eagle-small" if k == 1 else f"chain-{2 * k}"))
    data = load_shards(data_dir) if isinstance(data_dir, str) else data_dir
    n_val = max(1, len(data) // 20)
    train_set, val_set = data[:-n_val], data[-n_val:]
    cfg = FalconConfig.from_target(target.config, k=k, fusion=fusion, num_layers=layers, tree=tree)
    drafter = FalconDrafter(cfg)
    drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    steps_per_epoch = math.ceil(len(train_set) / batch_size)
    total = max_steps or steps_per_epoch * epochs
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * max(0.0, 1 - s / total))
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, "checkpoint.pt")
    state = {"step": 0, "epoch": 0, "history": []}
    if resume and os.path.exists(ckpt):
        c = torch.load(ckpt, weights_only=False)
        drafter.load_state_dict(c["model"])
        opt.load_state_dict(c["opt"])
        sched.load_state_dict(c["sched"])
        state = c["state"]
        rng.setstate(c["rng_py"])
        gen.set_state(c["rng_gen"])
        torch.set_rng_state(c["rng_torch"])
        log(f"resumed at step {state['step']}")
    tree_obj = build_tree(tree, k)
    t0 = time.time()
    drafter.train()
    bar = tqdm(total=total, initial=state["step"], desc=f"train {mode}", unit="step")
    while state["step"] < total:
        if stop_after_epochs is not None and state["epoch"] >= stop_after_epochs:
            bar.close()
            return {"stopped": True, "state": state, "out": out_dir}  # resume later from checkpoint.pt
        epoch = state["epoch"]
        order = list(range(len(train_set)))
        random.Random(seed + epoch).shuffle(order)
        start = (state["step"] % steps_per_epoch) * batch_size
        for i in range(start, len(order), batch_size):
            if state["step"] >= total:
                break
            batch = make_batch([train_set[j] for j in order[i:i + batch_size]], k, max_len)
            feats = add_noise(batch["feat_in"], batch["lengths"], noise, gen)
            ids = batch["ids_in"]
            loss_mask = batch["loss"]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                if glance != "none":
                    with torch.no_grad():  # token argmaxes on loss positions only (the LM head dominates)
                        pred0 = forward(drafter, ids, feats, batch)
                        p_ids = torch.full_like(ids, -1)
                        t_ids = torch.full_like(ids, -2)
                        p_ids[loss_mask] = drafter.logits(pred0[loss_mask]).argmax(-1)
                        t_ids[loss_mask] = drafter.logits(batch["feat_lbl"][loss_mask]).argmax(-1)
                    pos = glance_positions(p_ids, t_ids, loss_mask, k, lam(epoch, epochs, lambda_schedule), glance, rng)
                    ids, feats = apply_glance({**batch, "ids_in": ids, "feat_in": feats}, pos)
                    if glance_loss == "mask":
                        loss_mask = loss_mask.clone()
                        for b, p in enumerate(pos):
                            loss_mask[b, p] = False
                pred = forward(drafter, ids, feats, batch)
                loss, parts = losses(drafter, pred, batch, loss_mask, w_dist, alpha)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(drafter.parameters(), 0.5)
            opt.step()
            sched.step()
            state["step"] += 1
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{parts['acc']:.2f}")
        else:
            state["epoch"] += 1
            if eval_every_epoch:
                ev = evaluate(drafter, val_set, tree_obj, k, max_len)
                ev.update(epoch=state["epoch"], step=state["step"], seconds=round(time.time() - t0, 1))
                state["history"].append(ev)
                log(f"epoch {state['epoch']}: {json.dumps(ev)}")
            torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "state": state, "rng_py": rng.getstate(), "rng_gen": gen.get_state(),
                        "rng_torch": torch.get_rng_state()}, ckpt)
    bar.close()
    final = evaluate(drafter, val_set, tree_obj, k, max_len)
    final.update(steps=state["step"], seconds=round(time.time() - t0, 1), train_conversations=len(train_set),
                 heldout_conversations=len(val_set))
    cfg.extra = {"training": {"mode": mode, "glance": glance, "glance_loss": glance_loss,
                              "lambda_schedule": lambda_schedule, "noise": noise, "lr": lr, "batch_size": batch_size,
                              "steps": state["step"], "heldout": final}}
    drafter.eval()
    drafter.save_pretrained(out_dir, dtype=save_dtype)
    if mode == "eagle":
        export_vllm_eagle(drafter, os.path.join(out_dir, "vllm-eagle"))
    return {"final": final, "history": state["history"], "out": out_dir}


def export_vllm_eagle(drafter: FalconDrafter, out: str) -> None:
    """Export a k=1 fc drafter in the layout of vLLM's built-in EAGLE-1 (EagleLlamaForCausalLM)."""
    from safetensors.torch import save_file

    cfg = drafter.config
    if cfg.k != 1 or cfg.fusion != "fc" or cfg.fc_bias:
        raise ValueError("only k=1 fc drafters without fc bias have vLLM's EAGLE layout")
    d = cfg.to_hf_dict()
    d.pop("falcon")
    d["architectures"] = ["LlamaForCausalLM"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    save_file({n: t.detach().contiguous() for n, t in drafter.state_dict().items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def add_arguments(p):
    p.add_argument("--data", required=True, help="gen-data output directory")
    p.add_argument("--out", required=True, help="output drafter directory (checkpoint.pt for resume)")
    p.add_argument("--target", default=None, help="target HF dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--mode", choices=["falcon", "eagle"], default="falcon")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--fusion", choices=["lstm", "fc"], default="lstm")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--glance", choices=["uniform", "error", "none"], default="uniform")
    p.add_argument("--glance-loss", choices=["keep", "mask"], default="keep")
    p.add_argument("--lambda-schedule", choices=["code", "paper"], default="code")
    p.add_argument("--noise", choices=["scaled", "fixed"], default="scaled")
    p.add_argument("--tree", default=None, help="default tree recorded in the drafter and used for sim tau")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--bf16", action="store_true",
                   help="bf16 autocast (off by default: on a 2-core AVX-512 CPU one step measured 26x slower "
                        "than fp32, 242 s vs 9.3 s at batch 8)")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="dtype of the stored weights (bf16 keeps a 1-layer drafter small enough for git)")


def main(args):
    from falcon_vllm.models import model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    res = train(args.data, args.out, target_dir=args.target or str(model_path()), mode=args.mode, k=args.k,
                fusion=args.fusion, layers=args.layers, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                max_len=args.max_len, glance=args.glance, glance_loss=args.glance_loss,
                lambda_schedule=args.lambda_schedule, noise=args.noise, tree=args.tree, max_steps=args.max_steps,
                save_dtype=getattr(torch, args.save_dtype), bf16=args.bf16)
    with open(os.path.join(args.out, "training_log.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["final"]))
    return 0
