"""FalconDrafter: the semi-autoregressive (SAR) drafter of Falcon (Gao et al., AAAI 2025), pure torch.

Drafter position j reads ``[E(x_{j+1}); f_j]`` where E is the target's embedding and f_j the
target's last hidden state after its final norm (EAGLE's one-step shift).  A fusion layer maps
2H -> H (``lstm``: the official 2-layer LSTM applied per position from a zero state; ``fc``:
EAGLE's Linear), then N Llama decoder layers (layer 0 without input norm, no final norm), then
the target's frozen LM head.  The embedding and LM head are the target's, attached at run time
with :meth:`FalconDrafter.attach_target`, and never stored in our checkpoints.

Truncated draft vocabulary (``config.draft_vocab_size = N``): the drafter then has its own LM head
over N target tokens (the most frequent ones in its training answers) and a ``d2t`` map stored in
the checkpoint, in EAGLE-3's convention: target id = draft id + ``d2t[draft id]``.  A pass then
costs N instead of V rows of the head; :meth:`FalconDrafter.topk_tokens` proposes target ids, so
verification (and hence the output) is unchanged.

SAR blocks: inside a chunk, a *relaxed* causal mask lets every position see its whole k-block;
blocks are aligned to the END of the chunk (``chunk_mask``), so the last k positions always form
one block.  Block position r (0..k-1) is trained to output f_{e+1+r} where e is the block's last
position: one pass of the last block predicts the next k features, hence k tokens.

Block order (``config.block_order``).  In the paper's order ("forward") block position r outputs
level r+1, so level 1 (the next token, the one that matters most) comes out of the block's FIRST
position, whose own input is k-1 steps old: it must fetch the newest input through attention.
"reversed" lets the block's LAST position (newest input, as in EAGLE) output level 1, position k-2
level 2, and so on.  :meth:`FalconDrafter.forward` returns its outputs in level order either way
(reversed inside each end-aligned block), so training labels and every caller are unchanged.

Intermediate target layers (``config.aux_layers``, EAGLE-3's idea): at positions whose features come
from the target, the drafter may also read the residual stream entering a few target layers.  Each is
RMS-normed (the early layers carry massive activations), projected to H by one zero-initialised Linear,
and added to f_j before the fusion.  Such ``features`` are ``[f_j ; aux]`` (H + n*H wide); features the
drafter predicted itself (tree passes, glanced positions) are H wide and carry no aux term.

Attention here takes an explicit boolean mask over ``[past ; new]`` keys, so the same module
serves training (one chunk), the chunk pass and the tree passes of the reference engine.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from falcon_vllm.config import FalconConfig, read_config_json

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V): [B, kv_heads, P, head_dim]


# ---------------------------------------------------------------------- masks
def chunk_mask(past_len: int, chunk_len: int, k: int, device=None) -> torch.Tensor:
    """Relaxed block-causal mask for a chunk, blocks aligned to the chunk's end.

    Returns [chunk_len, past_len + chunk_len] bool (True = may attend).  Every query sees the
    whole past; chunk query i sees chunk key c iff c's block is not after i's block, where the
    blocks are ``[T-k, T), [T-2k, T-k), ...`` (the first one may be partial).
    """
    i = torch.arange(chunk_len, device=device)
    blk = (chunk_len - 1 - i) // k  # 0 for the last block, counting backwards
    inner = blk[None, :] >= blk[:, None]  # [T, T]: key block at or before query block
    past = torch.ones(chunk_len, past_len, dtype=torch.bool, device=device)
    return torch.cat([past, inner], dim=1)


def causal_context_mask(length: int, k: int, device=None) -> torch.Tensor:
    """The attention of serving's first pass for every end-aligned block of a sequence at once.

    vLLM's proposer writes the drafter's K/V of verified positions with a causal chunk pass, then runs
    only the newest k positions as a relaxed block over that causal prefix; the training mask
    (:func:`chunk_mask`) relaxes every block of the chunk instead.  With more than one layer the two give
    the earlier positions different K/V.  This mask is for a sequence fed twice, ``[block copy ; causal
    copy]`` (each ``length`` long, the same rotary positions): block-copy query i sees its own block's
    block copies and the causal copies before that block; causal-copy query i sees causal copies 0..i.
    The block copy's outputs are then what serving's first pass computes at each block.
    Returns [2 * length, 2 * length] bool."""
    i = torch.arange(length, device=device)
    blk = (length - 1 - i) // k                       # 0 for the last block, as in chunk_mask
    start = (i - block_offsets(length, k, device=device)[0]).clamp(min=0)  # i's block's first position
    own = blk[None, :] == blk[:, None]
    before = i[None, :] < start[:, None]
    causal = i[None, :] <= i[:, None]
    top = torch.cat([own, before], dim=1)
    bottom = torch.cat([torch.zeros_like(causal), causal], dim=1)
    return torch.cat([top, bottom], dim=0)


# ---------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """positions [B, T] -> cos, sin [B, 1, T, head_dim] (Llama 'rotate_half' convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                              dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: FalconConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, positions, mask, past):
        """x [B, T, H]; positions [B, T]; mask [B, T, P+T] bool; past (K, V) [B, nkv, P, hd] or None.

        Returns (out [B, T, H], (K_new, V_new) [B, nkv, T, hd] for the T new tokens).
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)   # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, self.hd, self.theta, q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            k_all, v_all = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        else:
            k_all, v_all = k, v
        rep = self.nh // self.nkv
        if rep > 1:
            k_all = k_all.repeat_interleave(rep, dim=1)
            v_all = v_all.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask[:, None])  # [B, nh, T, hd]
        o = o.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.o_proj(o), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: FalconConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: FalconConfig, index: int):
        super().__init__()
        # layer 0 reads the fusion output directly (no input norm), as in EAGLE and Falcon
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if index > 0 else nn.Identity()
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, mask, past):
        a, kv = self.self_attn(self.input_layernorm(x), positions, mask, past)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv


class PositionwiseLSTM(nn.LSTM):
    """Falcon's fusion: ``nn.LSTM(2H, H, num_layers=2)`` applied to each position from a zero state.

    The official code calls the LSTM on a [1, T, 2H] tensor with ``batch_first=False``, i.e. a
    sequence of length 1 with batch T: no recurrence over tokens.  We compute exactly that, so
    official checkpoints load unchanged (``W_hh`` is kept but has no effect).
    """

    def __init__(self, hidden: int):
        super().__init__(input_size=2 * hidden, hidden_size=hidden, num_layers=2, bias=True, dropout=0.1)

    def forward(self, x):  # x [B, T, 2H] -> [B, T, H]
        B, T, D = x.shape
        with torch.autocast(device_type=x.device.type, enabled=False):  # oneDNN has no bf16-autocast LSTM
            out, _ = super().forward(x.reshape(1, B * T, D).to(self.weight_ih_l0.dtype))
        return out.reshape(B, T, -1)


def block_offsets(T: int, k: int, lengths: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """[B, T] (or [1, T] without ``lengths``) offset of each position inside its k-block, blocks aligned to the
    row's end (its length, default T).  A block's outputs come in level order, so offset r predicts level r+1."""
    j = torch.arange(T, device=device)[None]
    L = torch.full((1, 1), T, device=device) if lengths is None else lengths.to(device).long()[:, None]
    return (j - L) % k


def level_order(B: int, T: int, k: int, lengths: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """[B, T] index that reverses every full k-block of a row, blocks aligned to the row's end (its length,
    default T); a partial first block and padding keep their places.  Its own inverse."""
    j = torch.arange(T, device=device).expand(B, T)
    L = torch.full((B, 1), T, device=device) if lengths is None else lengths.to(device).long()[:, None]
    r = block_offsets(T, k, lengths, device)          # offset inside its end-aligned block
    start = j - r
    full = (start >= 0) & (j < L)
    return torch.where(full, start + (k - 1 - r), j)


# ---------------------------------------------------------------------- the drafter
class FalconDrafter(nn.Module):
    """Falcon SAR drafter (see module docstring).  ``forward`` returns predicted features."""

    def __init__(self, cfg: FalconConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        if cfg.fusion == "lstm":
            self.lstm = PositionwiseLSTM(H)
        else:
            self.fc = nn.Linear(2 * H, H, bias=cfg.fc_bias)
        if cfg.aux_layers:
            self.aux_norm = nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in cfg.aux_layers)
            self.aux_proj = nn.Linear(len(cfg.aux_layers) * H, H, bias=False)
            nn.init.zeros_(self.aux_proj.weight)  # starts as the drafter without them
        if cfg.level_embedding:  # [k, H], zero-initialised: starts as the drafter without it
            self.level_emb = nn.Parameter(torch.zeros(cfg.k, H))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self._target: tuple[nn.Module, nn.Module] | None = None  # (embed_tokens, lm_head), not saved
        if cfg.draft_vocab_size:  # own head over N target tokens; d2t: target id = draft id + d2t[draft id]
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    @property
    def k(self) -> int:
        return self.config.k

    # -- target sharing -------------------------------------------------
    def attach_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> "FalconDrafter":
        """Share the target's embedding and LM head (kept outside this module's parameters)."""
        w = embed_tokens.weight
        if w.shape[1] != self.config.hidden_size or w.shape[0] != self.config.vocab_size:
            raise ValueError(f"falcon-vllm: drafter (hidden {self.config.hidden_size}, vocab {self.config.vocab_size}) "
                             f"does not fit the target embedding {tuple(w.shape)}")
        self._target = (embed_tokens, lm_head)
        if self.config.frozen_head:  # the head is the target's rows of the draft tokens (the checkpoint has none)
            with torch.no_grad():
                rows = lm_head.weight[self.draft_ids.to(lm_head.weight.device)]
                self.lm_head.weight.copy_(rows.to(self.lm_head.weight))
            self.lm_head.weight.requires_grad_(False)
        return self

    def init_draft_head(self, token_ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """Set the truncated head to the target's LM-head rows of ``token_ids`` [N] (target ids, any
        order; stored sorted) and the matching ``d2t`` map."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).sort().values
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"falcon-vllm: init_draft_head: need {self.config.draft_vocab_size} distinct token ids")
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_head[ids].to(self.lm_head.weight.dtype))
            self.d2t.copy_(ids - torch.arange(ids.numel()))

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """[N] target id of each draft id (None: the head is the target's)."""
        if not self.config.draft_vocab_size:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def target_to_draft(self) -> torch.Tensor | None:
        """[V] draft id of each target id, -1 where the target token is not in the draft vocabulary."""
        ids = self.draft_ids
        if ids is None:
            return None
        t2d = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
        t2d[ids] = torch.arange(ids.numel(), device=ids.device)
        return t2d

    def _need_target(self):
        if self._target is None:
            raise RuntimeError("falcon-vllm: call FalconDrafter.attach_target(embed_tokens, lm_head) first")
        return self._target

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._need_target()[0](ids)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Drafter logits over its vocabulary: [..., V], or [..., N] for a truncated head (draft ids)."""
        if self.config.draft_vocab_size:
            return self.lm_head(features)
        return self._need_target()[1](features)

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's own logits [..., V] (its LM head, the teacher in training)."""
        return self._need_target()[1](features)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (identity for the target's head)."""
        return draft_ids if not self.config.draft_vocab_size else draft_ids + self.d2t[draft_ids]

    def topk_tokens(self, features: torch.Tensor, topk: int) -> torch.Tensor:
        """features [..., H] -> the drafter's top-``topk`` candidates [..., topk] as target ids (rank order)."""
        return self.to_target_ids(self.logits(features).topk(topk, dim=-1).indices)

    # -- forward ---------------------------------------------------------
    def fuse(self, token_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        H = self.config.hidden_size
        if features.shape[-1] != H:  # [f ; aux]: the target's final-norm states and its intermediate ones
            n = len(self.config.aux_layers)
            if features.shape[-1] != H * (1 + n):
                raise ValueError(f"falcon-vllm: features of width {features.shape[-1]}: this drafter reads {H} "
                                 f"(or {H * (1 + n)} with its aux layers {list(self.config.aux_layers)})")
            aux = features[..., H:].to(token_embeds.dtype).split(H, dim=-1)
            features = features[..., :H] + self.aux_proj(torch.cat([m(a) for m, a in zip(self.aux_norm, aux)], -1))
        x = torch.cat([token_embeds, features.to(token_embeds.dtype)], dim=-1)  # [B, T, 2H], embedding first
        return self.lstm(x) if self.config.fusion == "lstm" else self.fc(x)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, past: KVCache | None = None, lengths: torch.Tensor | None = None):
        """One drafter pass.

        Args:
            token_embeds: [B, T, H] embeddings of x_{j+1} for each position j.
            features: [B, T, H] target features f_j (or predicted features in tree passes).
            positions: [B, T] int64 rotary positions.
            mask: [B, T, P+T] or [T, P+T] bool, True = attend (keys: past then new).
            past: per-layer (K, V) [B, nkv, P, hd], or None.
            lengths: [B] real positions of right-padded rows (blocks end at each row's length; default T).
        Returns:
            (out [B, T, H] predicted features, new_kv: per-layer (K, V) [B, nkv, T, hd]).
        """
        if mask.dim() == 2:
            mask = mask.expand(token_embeds.shape[0], *mask.shape)
        x = self.fuse(token_embeds, features)
        if self.config.level_embedding:  # each row's offset inside its end-aligned block
            x = x + self.level_emb.to(x.dtype)[block_offsets(x.shape[1], self.k, lengths, x.device)]
        new_kv: KVCache = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, mask, past[i] if past is not None else None)
            new_kv.append(kv)
        if self.config.block_order == "reversed" and self.k > 1:
            x = x.gather(1, level_order(x.shape[0], x.shape[1], self.k, lengths, x.device)[..., None].expand_as(x))
        return x, new_kv

    # -- checkpoints -----------------------------------------------------
    def save_pretrained(self, directory: str, dtype: torch.dtype | None = None) -> None:
        """Write config.json + model.safetensors (optionally cast, e.g. bf16 to halve the size)."""
        from safetensors.torch import save_file

        self.config.save(directory)
        state = {k: v.detach().to(dtype if dtype and v.is_floating_point() else v.dtype).contiguous().cpu()
                 for k, v in self.state_dict().items() if not (self.config.frozen_head and k == "lm_head.weight")}
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str, target_config=None, dtype=torch.float32) -> "FalconDrafter":
        cfg = FalconConfig.load(directory)
        if target_config is not None:
            cfg.check_target(target_config)
        model = cls(cfg)
        state = load_state_dict_file(directory)
        model.load_state_dict(check_state_dict(model, state, directory), strict=not cfg.frozen_head)
        return model.to(dtype).eval()

    @classmethod
    def load(cls, directory: str, target_config=None, dtype=torch.float32) -> "FalconDrafter":
        """A drafter in either layout: ours (config.json has a ``falcon`` section) or vLLM's EAGLE-1 layout."""
        d, _ = read_config_json(directory, kind="drafter")
        return (cls.from_pretrained if "falcon" in d else cls.from_vllm_eagle)(directory, target_config, dtype)

    @classmethod
    def from_vllm_eagle(cls, directory: str, target_config=None, dtype=torch.float32) -> "FalconDrafter":
        """Load an EAGLE-1 drafter stored in vLLM's ``method: "eagle"`` layout (a Llama config without
        a ``falcon`` section; the files :func:`falcon_vllm.train.trainer.export_vllm_eagle` writes) as
        the k=1 fc drafter it is, so the reference engine can run it."""
        d, path = read_config_json(directory, kind="EAGLE drafter")
        if "falcon" in d:
            raise ValueError(f"falcon-vllm: {path} is a Falcon-format drafter; load it with "
                             "FalconDrafter.from_pretrained")
        cfg = FalconConfig.from_hf_dict({**d, "falcon": {"k": 1, "fusion": "fc"}}, source=path)
        if target_config is not None:
            cfg.check_target(target_config)
        model = cls(cfg)
        model.load_state_dict(check_state_dict(model, load_state_dict_file(directory), directory),
                              strict=not cfg.frozen_head)
        return model.to(dtype).eval()


HEAD_KEYS = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")  # the head; tied: the embedding
EMBED_KEYS = HEAD_KEYS[1:]  # the input embedding


def target_tensor(target_dir: str, keys: tuple[str, ...]) -> tuple[str, torch.Tensor]:
    """The first of ``keys`` that the target's safetensors files hold (one file or shards), and that tensor: one
    tensor read, not the whole model."""
    import glob

    from safetensors import safe_open

    where = {}
    for path in sorted(glob.glob(os.path.join(target_dir, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for key in set(keys) & set(f.keys()):
                where.setdefault(key, path)
    key = next((k for k in keys if k in where), None)
    if key is None:
        raise ValueError(f"falcon-vllm: {target_dir} holds no safetensors file with {' or '.join(keys)}")
    with safe_open(where[key], "pt") as f:
        return key, f.get_tensor(key)


def target_head_rows(target_dir: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the target's LM head, read from its safetensors files (a target with tied embeddings stores
    no head: its embedding's rows).  A frozen-head drafter's head (``frozen_head``) is made of them at load."""
    try:
        key, weight = target_tensor(target_dir, HEAD_KEYS)
    except ValueError as e:
        raise ValueError(f"falcon-vllm: the drafter's head is the target's LM-head rows (frozen_head), but {e}") \
            from None
    if int(ids.max()) >= weight.shape[0]:
        raise ValueError(f"falcon-vllm: the drafter's d2t map names token {int(ids.max())}, past the target's "
                         f"{weight.shape[0]}-row {key}")
    return weight[ids.long()].clone()


def load_state_dict_file(directory: str) -> dict[str, torch.Tensor]:
    """Read model.safetensors (or an official pytorch_model.bin) from a drafter directory."""
    st = os.path.join(directory, "model.safetensors")
    pt = os.path.join(directory, "pytorch_model.bin")
    if os.path.exists(st):
        from safetensors.torch import load_file
        try:
            return load_file(st)
        except Exception as e:  # safetensors raises several error types for corrupt files
            raise ValueError(f"falcon-vllm: {st} is corrupt or truncated ({type(e).__name__}: {e})") from None
    if os.path.exists(pt):
        try:
            return torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"falcon-vllm: {pt} could not be read ({type(e).__name__}: {e})") from None
    raise FileNotFoundError(f"falcon-vllm: Falcon drafter {directory!r} has no weights (model.safetensors)")


def check_state_dict(model: nn.Module, state: dict, source: str) -> dict:
    """Map official Falcon keys onto ours and check names and shapes, with one clear error."""
    state = dict(official_weights(state.items(), keep_lm_head="lm_head.weight" in model.state_dict()))
    own = model.state_dict()
    if model.config.frozen_head:  # the head's rows come from the target (attach_target), not the checkpoint
        own.pop("lm_head.weight")
    if "d2t" in own:
        check_d2t(state.get("d2t"), own["d2t"].numel(), model.config.vocab_size, source)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [f"{n}: checkpoint {tuple(state[n].shape)} vs model {tuple(own[n].shape)}"
             for n in own if n in state and state[n].shape != own[n].shape]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''}")
        if wrong:
            parts.append("wrong shapes " + "; ".join(wrong[:3]))
        raise ValueError(f"falcon-vllm: {source}: weights do not match the drafter config: " + ", ".join(parts))
    return state


def check_d2t(d2t: torch.Tensor | None, n: int, vocab: int, source: str) -> None:
    """A truncated head needs its draft->target map: present, integer, N entries, distinct ids in range."""
    if d2t is None:
        raise ValueError(f"falcon-vllm: {source}: the drafter has a truncated head ({n} of {vocab} tokens) but its "
                         "weights carry no 'd2t' map (draft id -> target id); without it the drafts would be the "
                         "wrong tokens. Re-export the checkpoint with its map")
    if d2t.is_floating_point() or d2t.shape != (n,):
        raise ValueError(f"falcon-vllm: {source}: 'd2t' must be an integer tensor of shape ({n},), got {d2t.dtype} "
                         f"{tuple(d2t.shape)}")
    ids = torch.arange(n) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != n:
        raise ValueError(f"falcon-vllm: {source}: 'd2t' maps draft ids outside the target vocabulary [0, {vocab}) "
                         "or onto the same target id twice")


def official_weights(items, keep_lm_head: bool = False):
    """Official Falcon/EAGLE checkpoint (name, tensor) pairs -> ours, lazily (a state dict's items or
    vLLM's weight iterator).

    Official keys: ``embed_tokens.weight`` (a frozen copy of the target's: dropped, we share the
    target's), ``lstm.weight_ih_l{0,1}`` etc. (kept), ``fc.*`` (EAGLE, kept), ``layers.N.*`` (kept),
    ``lm_head.*`` (kept only for a truncated head, ``keep_lm_head``).  A ``model.`` prefix (as in some
    exports) is stripped.
    """
    for name, t in items:
        name = name.removeprefix("model.")
        if name.startswith("embed_tokens.") or (name.startswith("lm_head.") and not keep_lm_head):
            continue
        yield name, t
