"""Tiny models with known behaviour, built in memory (no download): for tests and smoke runs.

* :func:`tiny_llama` - a random Llama (or Qwen2) causal LM.
* :func:`increment_llama` - a Llama whose greedy next token is always ``t + 1 (mod V)``:
  embeddings are points on a torus (``e_t = [cos(2 pi w t / V), sin(2 pi w t / V)]_w``), every
  ``o_proj``/``down_proj`` is zero so the residual stream stays ``e_t``, and ``lm_head[v] = e_{v-1}``.
  Shifting a token by s is then the rotation ``R^s`` of its embedding.
* :func:`context_llama` - the increment model with a small random attention output and a sharpened
  LM head: its next token is t+1+d with d mostly in {-2..2}, and the distribution of d depends on
  the whole context, not only on the last token.
* :func:`exact_drafter` - a Falcon drafter (fc fusion) that predicts that target perfectly: it
  maps the embedding of ``x_{j+1}`` to ``R^(k-1) e_{x_{j+1}}``, whose LM-head argmax is
  ``x_{j+1} + k = x_{j+k+1}``: exactly what drafter position j must predict.
* :func:`random_drafter` - a randomly initialised drafter for any target.
"""

from __future__ import annotations

import math

import torch

from falcon_vllm.config import FalconConfig
from falcon_vllm.drafter import FalconDrafter


def tiny_llama(vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               inter: int = 128, seed: int = 0, qwen2: bool = False, max_pos: int = 2048, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, intermediate_size=inter, max_position_embeddings=max_pos,
              rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1,
              pad_token_id=0)
    if qwen2:
        cfg = Qwen2Config(**kw, rope_theta=1e6)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**kw)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init: peaked, tie-free distributions
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.4 / math.sqrt(p.shape[1]) if "embed" not in name else 1.0)
            elif tied and name.endswith("proj.bias"):  # Qwen2's q/k/v biases, which start at zero
                p.normal_(0, 0.5)
    return model.float().eval()


def _torus_embeddings(vocab: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings e_t [V, H] on a torus and the rotation R [H, H] with e_{t+1} = R e_t."""
    m = hidden // 2
    w = torch.arange(1, m + 1, dtype=torch.float64)
    ang = 2 * math.pi * torch.arange(vocab, dtype=torch.float64)[:, None] * w / vocab  # [V, m]
    emb = torch.cat([ang.cos(), ang.sin()], dim=1)
    R = torch.zeros(hidden, hidden, dtype=torch.float64)
    c, s = (2 * math.pi * w / vocab).cos(), (2 * math.pi * w / vocab).sin()
    idx = torch.arange(m)
    R[idx, idx], R[idx, idx + m] = c, -s
    R[idx + m, idx], R[idx + m, idx + m] = s, c
    return emb, R


def increment_llama(vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2):
    """A Llama whose greedy continuation of any context ending in t is t+1, t+2, ... (mod V)."""
    model = tiny_llama(vocab, hidden, layers, heads, kv_heads)
    emb, _ = _torus_embeddings(vocab, hidden)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb.float())
        model.lm_head.weight.copy_(emb.roll(1, dims=0).float())  # lm_head[v] = e_{v-1}
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    return model


def context_llama(vocab: int = 128, hidden: int = 128, heads: int = 2, kv_heads: int = 1, sharp: float = 1000.0,
                  eps: float = 0.1, seed: int = 7):
    """:func:`increment_llama` with ``lm_head`` scaled by ``sharp`` and random ``o_proj`` of scale ``eps``."""
    model = increment_llama(vocab, hidden, heads=heads, kv_heads=kv_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharp)
        for layer in model.model.layers:
            w = layer.self_attn.o_proj.weight
            w.copy_(torch.randn(w.shape, generator=g) * eps / math.sqrt(w.shape[1]))
    return model


def exact_drafter(target, k: int = 2, num_layers: int = 1) -> FalconDrafter:
    """A perfect drafter for :func:`increment_llama` (see module docstring)."""
    cfg = FalconConfig.from_target(target.config, k=k, fusion="fc", num_layers=num_layers)
    d = FalconDrafter(cfg)
    _, R = _torus_embeddings(cfg.vocab_size, cfg.hidden_size)
    H = cfg.hidden_size
    with torch.no_grad():
        d.fc.weight.zero_()
        d.fc.weight[:, :H] = torch.linalg.matrix_power(R, k - 1).float()
        for layer in d.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return d.eval()


def random_drafter(target, k: int = 2, fusion: str = "lstm", num_layers: int = 1, seed: int = 1,
                   block_order: str = "forward", level_embedding: bool = False, **overrides) -> FalconDrafter:
    torch.manual_seed(seed)
    cfg = FalconConfig.from_target(target.config, k=k, fusion=fusion, num_layers=num_layers, block_order=block_order,
                                   level_embedding=level_embedding, **overrides)
    d = FalconDrafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / math.sqrt(p.shape[1]))
            elif cfg.attention_bias and name.endswith("proj.bias"):  # a Qwen2-style layer's q/k/v biases
                p.normal_(0, 0.5)
    return d.float().eval()


def truncate_head(drafter: FalconDrafter, target, token_ids, frozen: bool = False) -> FalconDrafter:
    """A copy of ``drafter`` whose LM head covers only ``token_ids`` (the target's rows, with its d2t map);
    ``frozen``: a head that stays the target's rows, saved as its d2t map alone."""
    from dataclasses import replace

    ids = torch.as_tensor(token_ids, dtype=torch.long)
    d = FalconDrafter(replace(drafter.config, draft_vocab_size=ids.numel(), frozen_head=frozen))
    d.load_state_dict(drafter.state_dict(), strict=False)
    d.init_draft_head(ids, target.get_output_embeddings().weight)
    return d.float().eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with transformers' generate (the reference for losslessness)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
