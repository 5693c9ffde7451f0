"""The Falcon drafter as a vLLM model (``EagleFalconForCausalLM``).

It follows vLLM's EAGLE-1 drafter contract (``forward(input_ids, positions, hidden_states) ->
(h, h)``, shared embedding and LM head, attention layers numbered after the target's so they get
their own draft KV cache) and replaces EAGLE's ``fc`` by Falcon's fusion: the official 2-layer LSTM
applied per position (``lstm``) or a Linear (``fc``).  It loads falcon-vllm checkpoints and
official Falcon state dicts (``embed_tokens.*`` is dropped: the target's embedding is shared).

Whether a pass is causal (chunk pass) or sees its whole k-block (SAR block passes) is decided by
the attention metadata the proposer builds, not by this module.

A drafter with a truncated head (``draft_vocab_size`` N < vocab) keeps its own N-row LM head and
the ``d2t`` map (target id = draft id + d2t[draft id]); ``compute_logits`` then returns draft-id
logits and the proposer maps its picks with :meth:`to_target_ids`.  ``EagleD2TLlamaForCausalLM``
gives vLLM's stock EAGLE-1 drafter the same head (its logits scattered back into the target
vocabulary, since the stock proposer takes the argmax as a target id).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn as nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import LinearBase, ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM, LlamaDecoderLayer
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.platforms import current_platform

from falcon_vllm.drafter import PositionwiseLSTM, official_weights
from falcon_vllm.serving import Serving
from falcon_vllm.vllm.options import GEMM_DTYPE_ENV, check_gemm_dtype


def gemm_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of the drafter's matmuls (weights and inputs; None: the model's dtype).  ``choice``: the
    speculative config's ``draft_gemm_dtype``, else ``$FALCON_VLLM_DRAFT_GEMM_DTYPE``, else auto (the only
    settings for vLLM's EAGLE proposer running :class:`EagleD2TLlamaForCausalLM`).

    ``auto``, serving an fp32 model on a CPU: bfloat16 where the CPU has AMX tiles (the drafter then reads half
    the weight bytes per pass); else int8 where it has int8 dot-product units (VNNI: a quarter of the bytes; on
    2-core AVX512-BF16 CPUs without AMX the drafter's matmuls ran faster in int8 than in bf16); else bfloat16
    where it has AVX512-BF16; the model's dtype otherwise.  ``int8`` (CPU only): int8 weights with a scale per output
    channel, inputs quantized per row as they come (the fusion layer's embedding and state apart:
    :func:`int8_linear_split`; vLLM's oneDNN W8A8 kernels), a quarter of fp32's weight bytes.  Activations
    between the matmuls, the KV cache and the outputs keep the model's dtype; drafts
    change slightly, verification not at all, so outputs stay exactly vanilla's."""
    check_gemm_dtype(choice, f"draft_gemm_dtype (or ${GEMM_DTYPE_ENV})")
    if choice == "model" or (choice != "int8" and model_dtype == torch.bfloat16):
        return None
    if not current_platform.is_cpu():
        if choice in ("bfloat16", "int8"):
            raise ValueError(f"falcon-vllm: draft_gemm_dtype {choice!r} is for CPU serving; on GPUs serve the "
                             "target in bf16 instead (--dtype bfloat16)")
        return None
    if choice == "auto":
        if model_dtype != torch.float32:
            return None
        return auto_gemm_dtype()
    return torch.int8 if choice == "int8" else torch.bfloat16


def auto_gemm_dtype(amx: bool | None = None, vnni: bool | None = None,
                    avx512_bf16: bool | None = None) -> torch.dtype | None:
    """``draft_gemm_dtype`` auto for an fp32 model on a CPU with these units (each not given: this CPU's): bf16
    with AMX and AVX512-BF16, else int8 with VNNI, else bf16 with AVX512-BF16, else None (the model's dtype).  The
    measurements behind each choice (``benchmarks/draft_gemm_dtypes.py``, same-run A/Bs): ``docs/findings.md``."""
    amx = torch.cpu._is_amx_tile_supported() if amx is None else amx
    vnni = torch.cpu._is_vnni_supported() if vnni is None else vnni
    avx512_bf16 = torch.cpu._is_avx512_bf16_supported() if avx512_bf16 is None else avx512_bf16
    if amx and avx512_bf16:
        return torch.bfloat16
    if vnni:
        return torch.int8
    return torch.bfloat16 if avx512_bf16 else None


def cast_gemm_weights(modules, dtype: torch.dtype | None) -> None:
    """Before vLLM processes the loaded weights: the given linear layers' weights (and biases) to ``dtype``,
    so its CPU GEMM dispatch packs them for ``dtype``; :func:`wrap_gemms` then casts their inputs.  For int8
    the weights stay as loaded (vLLM packs them too, to no use) and :func:`wrap_gemms` quantizes them."""
    if dtype is None:
        return
    for m in modules:
        if dtype == torch.int8:  # kept from vLLM's dispatch, which drops a linear layer's weight once packed
            m.falcon_int8_weight = m.weight.data
        else:
            for name in ("weight", "bias"):
                p = getattr(m, name, None)
                if isinstance(p, torch.Tensor) and p.is_floating_point():
                    p.data = p.data.to(dtype)
        m.falcon_gemm_dtype = dtype


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """``x -> x @ weight.T + bias`` through vLLM's oneDNN W8A8 kernels: the weight quantized symmetrically with
    a scale per output channel, each input row quantized with its own scale when it comes; the output in the
    weight's dtype."""
    from vllm import _custom_ops as ops

    # a row of the [N, K] weight is an output channel: the kernel that quantizes inputs per row does it
    q, scale, _ = ops.onednn_scaled_int8_quant(weight.detach().float().contiguous(), None, None, True)
    scale = scale.view(1, -1)
    # the handler packs its own copy of the [K, N] weight (column-major, as it takes it) but keeps a pointer to
    # the scales: the returned function holds them
    handler = ops.create_onednn_scaled_mm(q.t(), scale, weight.dtype, True, False, 32)
    bias = None if bias is None else bias.detach().to(weight.dtype)
    n = q.shape[0]

    def linear(x: torch.Tensor, _w=None, _b=None, _scale=scale) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        xq, xs, _ = ops.onednn_scaled_int8_quant(rows, None, None, True)
        out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
        ops.onednn_scaled_mm(handler, xq, out, xs, None, None, bias)
        return out.reshape(*x.shape[:-1], n)

    return linear


def int8_linear_split(weight: torch.Tensor, bias: torch.Tensor | None, split: int):
    """:func:`int8_linear` of an input made of two parts (columns ``[:split]`` and ``[split:]``), each part's rows
    quantized with a scale of their own and the two products summed: the Falcon fusion's input is a token
    embedding (entries of about 0.01) beside the target's final-norm state (a few channels of 20-50), and one scale
    per row would round the whole embedding to zero."""
    a, b = int8_linear(weight[:, :split], bias), int8_linear(weight[:, split:], None)
    return lambda x, _w=None, _b=None: a(x[..., :split]) + b(x[..., split:])


def wrap_gemms(model: nn.Module) -> None:
    """After vLLM processed the weights: layers cast by :func:`cast_gemm_weights` take inputs in the model's
    dtype, multiply in theirs (int8: :func:`int8_linear`, the float weights dropped) and return the model's
    dtype."""
    for m in model.modules():
        dt = getattr(m, "falcon_gemm_dtype", None)
        inner = getattr(m, "cpu_linear", None)
        if dt is None or inner is None or getattr(m, "falcon_gemm_wrapped", False):
            continue
        if dt == torch.int8:
            w, b, split = m.falcon_int8_weight, getattr(m, "bias", None), getattr(m, "falcon_int8_split", None)
            # the fusion layers (falcon_int8_split): embedding and state scaled apart
            m.cpu_linear = int8_linear_split(w, b, split) if split else int8_linear(w, b)
            m.weight = nn.Parameter(torch.empty(0, dtype=m.falcon_int8_weight.dtype), requires_grad=False)
            del m.falcon_int8_weight
        else:
            m.cpu_linear = lambda x, w, b, inner=inner, dt=dt: inner(x.to(dt), w, b).to(x.dtype)
        m.falcon_gemm_wrapped = True


class CpuRMSNorm(nn.Module):
    """A drafter's RMSNorm through vLLM's C++ CPU kernels (``_C.rms_norm``, ``_C.fused_add_rms_norm``).

    vLLM's CPU platform runs RMSNorm through its PyTorch-native implementation, which torch.compile fuses; run
    eagerly (``enforce_eager``, or a drafter vLLM does not compile) the native one costs many times the C++
    kernel at a drafter's few rows (``docs/findings.md``); the shipped 2-layer drafter makes three calls per
    pass.  Compiled, the kernel is an opaque op in the graph.  The same arithmetic (fp32 within
    1e-6 of the native one): drafts could differ only in a near-tie, verification not at all."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight = norm.weight  # the same parameter: its checkpoint name is unchanged
        self.eps = norm.variance_epsilon

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        x = x.contiguous()
        if residual is None:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, self.weight, self.eps)
            return out
        torch.ops._C.fused_add_rms_norm(x, residual, self.weight, self.eps)  # x <- norm(x + residual), residual <- x + residual
        return x, residual


def use_cpu_norm_kernels(model: nn.Module) -> None:
    """On CPU, before the weights load: the drafter's RMSNorms to :class:`CpuRMSNorm` where the kernels take them
    (a weight, no variance override, channels a multiple of 16: the kernels' vector width)."""
    if not current_platform.is_cpu() or not hasattr(torch.ops._C, "fused_add_rms_norm"):
        return
    for name, m in list(model.named_modules()):
        if (type(m) is RMSNorm and m.has_weight and m.variance_size_override is None
                and m.weight.shape[-1] % 16 == 0):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, CpuRMSNorm(m))


def _compiles(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's torch.compile takes the drafter (when it compiles the target: not with enforce_eager): on
    CPU, fc fusion without a level embedding, whose per-pass row offsets are Python state set between passes.
    On GPUs the drafter stays eager: compiled, vLLM would also capture it in piecewise CUDA graphs, a path not yet
    run there."""
    falcon = getattr(vllm_config.speculative_config.draft_model_config.hf_config, "falcon", None) or {}
    return current_platform.is_cpu() and falcon.get("fusion", "lstm") == "fc" and not falcon.get("level_embedding")


def index_layers_from_drafter(config, target_layers: int) -> None:
    """A drafter's layers are named after the target's (``layers.{target_layers + i}``); a config with per-layer
    types (Qwen2's ``layer_types``) must be indexed from the drafter's first layer, as vLLM's EAGLE-3 drafters
    are: vLLM's Llama attention subtracts ``target_layer_count``."""
    config.target_layer_count = target_layers


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0}, enable_if=_compiles)
class FalconDraftModel(nn.Module):
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={
        ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1),
    })

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer_id: int = 0):
        super().__init__()
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        falcon = dict(getattr(self.config, "falcon", {}) or {})
        H = self.config.hidden_size
        self.fusion = falcon.get("fusion", "lstm")
        index_layers_from_drafter(self.config, start_layer_id)
        self.embed_tokens = VocabParallelEmbedding(self.config.vocab_size, H,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(vllm_config, i == 0, prefix=maybe_prefix(prefix, f"layers.{i + start_layer_id}"),
                              config=self.config)
            for i in range(self.config.num_hidden_layers))
        if self.fusion == "lstm":
            self.lstm = PositionwiseLSTM(H).eval()  # eval: no dropout at inference
        else:
            self.fc = ReplicatedLinear(input_size=2 * H, output_size=H, bias=bool(falcon.get("fc_bias", False)),
                                       params_dtype=vllm_config.model_config.dtype,
                                       prefix=maybe_prefix(prefix, "fc"), return_bias=False)
            self.fc.falcon_int8_split = H  # forward's input: the embedding's H columns, then the state's
        # level embedding (FalconConfig.level_embedding): one vector per block row, added to the fused input;
        # the proposer gives each pass its rows' offsets (set_level_offsets)
        self.level_emb = (nn.Parameter(torch.zeros(int(falcon.get("k", 2)), H, dtype=vllm_config.model_config.dtype),
                                       requires_grad=False) if falcon.get("level_embedding") else None)
        self._level_offsets: torch.Tensor | None = None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def set_level_offsets(self, offsets: torch.Tensor) -> None:
        """The next pass's row offsets [T] inside their k-blocks (0 = a block's oldest row); used once."""
        self._level_offsets = offsets

    def forward(self, input_ids, positions, hidden_states):
        x = torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1)  # [T, 2H], embedding first
        h = self.lstm(x[None])[0] if self.fusion == "lstm" else self.fc(x)
        if self.level_emb is not None:
            off, self._level_offsets = self._level_offsets, None
            if off is None:  # vLLM's warm-up and profiling runs (no request): any offset
                off = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
            h = h + self.level_emb[off[:h.shape[0]]].to(h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        h = h + residual  # no final norm (Falcon/EAGLE)
        return h, h

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)


class DraftHead:
    """The LM head of an EAGLE-style drafter: the target's (shared by vLLM), or a truncated one of
    ``draft_vocab_size`` rows with its ``d2t`` map (loaded from the checkpoint, never defaulted)."""

    def _init_head(self, prefix: str, model_dtype: torch.dtype, target: str | None = None) -> None:
        cfg = self.config
        self.model_dtype = model_dtype  # the dtype vLLM loads the weights in (before _cast_gemms)
        self.target_dir = target  # where a frozen head's rows are read (the served model's directory)
        n = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        cfg.draft_vocab_size = n
        self.truncated = n < cfg.vocab_size
        self.has_own_lm_head = self.truncated  # vLLM shares the target's head otherwise
        if self.truncated:
            self.lm_head = ParallelLMHead(n, cfg.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
            self.register_buffer("d2t", torch.full((n,), -1, dtype=torch.long), persistent=False)
        self.logits_processor = LogitsProcessor(n, scale=getattr(cfg, "logit_scale", 1.0))

    def _cast_gemms(self) -> None:
        """After loading: the drafter's own linear layers (and its truncated head) to its matmul dtype."""
        section = getattr(self.config, "falcon", None)
        serving = Serving.from_section(section) if isinstance(section, dict) else None
        choice = (serving and serving.draft_gemm_dtype) or os.environ.get(GEMM_DTYPE_ENV) or "auto"
        dtype = gemm_dtype(choice, self.model_dtype)
        own = [m for m in self.modules() if isinstance(m, LinearBase)] + ([self.lm_head] if self.truncated else [])
        cast_gemm_weights(own, dtype)

    def _split_head_weights(self, weights):
        """Take ``d2t`` out of the weight stream (checked, into the buffer); yield the rest."""
        seen = False
        for name, w in weights:
            if name.endswith("d2t"):
                if not self.truncated:
                    raise ValueError("falcon-vllm: the drafter checkpoint has a d2t map but no draft_vocab_size "
                                     "in its config.json")
                from falcon_vllm.drafter import check_d2t

                check_d2t(w, self.d2t.numel(), self.config.vocab_size, "drafter checkpoint")
                self.d2t.copy_(w.to(torch.long))
                seen = True
                continue
            yield name, w
        if self.truncated and not seen:
            from falcon_vllm.drafter import check_d2t

            check_d2t(None, self.d2t.numel(), self.config.vocab_size, "drafter checkpoint")
        if getattr(self.config, "frozen_head", False) and self.truncated:  # the head's rows are the target's
            from falcon_vllm.drafter import target_head_rows

            yield "lm_head.weight", target_head_rows(_local_dir(self.target_dir), self.to_target_ids(
                torch.arange(self.d2t.numel(), device=self.d2t.device)).cpu())

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (identity for the target's head)."""
        return draft_ids + self.d2t[draft_ids] if self.truncated else draft_ids


def _local_dir(model: str | None) -> str:
    """The served model's local directory (a hub name: its snapshot already on this machine, never downloaded)."""
    if model and os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception as e:
        raise ValueError(f"falcon-vllm: the drafter's head is the target's LM-head rows (frozen_head), but the "
                         f"target {model!r} is no local directory ({type(e).__name__}: {e})") from None


class EagleD2TLlamaForCausalLM(DraftHead, EagleLlamaForCausalLM):
    """vLLM's EAGLE-1 drafter with a truncated head (``d2t``): the same head as a Falcon drafter's, so
    the EAGLE baseline is compared at equal drafter cost.  Served by vLLM's stock EAGLE proposer."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        index_layers_from_drafter(vllm_config.speculative_config.draft_model_config.hf_config,
                                  vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._init_head(prefix, vllm_config.model_config.dtype, vllm_config.model_config.model)
        use_cpu_norm_kernels(self)
        # vLLM's EAGLE-1 fuses cat(embedding, state) as Falcon does: in int8 the two parts are scaled apart
        self.model.fc.falcon_int8_split = self.config.hidden_size

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)  # [T, N] draft ids
        if not self.truncated or logits is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.to_target_ids(torch.arange(logits.shape[1], device=logits.device)), logits)

    def load_weights(self, weights):
        loaded = super().load_weights(self._split_head_weights(weights))
        self._cast_gemms()
        return loaded


class EagleFalconForCausalLM(DraftHead, LlamaForCausalLM):
    """vLLM drafter for Falcon; the name starts with ``Eagle`` so vLLM's EAGLEConfig keeps it."""

    # our checkpoints never store the embedding (vLLM shares the target's); the LM head only when
    # truncated (DraftHead sets has_own_lm_head)
    has_own_embed_tokens = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        if getattr(self.config, "draft_vocab_size", None) is None:
            self.config.draft_vocab_size = self.config.vocab_size
        target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.model = FalconDraftModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                      start_layer_id=target_layers)
        self._init_head(prefix, vllm_config.model_config.dtype, vllm_config.model_config.model)
        use_cpu_norm_kernels(self)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def attach_falcon_proposer(self) -> None:
        """Called by FalconProposer.load_model: the proposer that runs this drafter is Falcon's."""
        self._falcon_proposer = True

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        if not getattr(self, "_falcon_proposer", False):
            # stock EAGLE would run a SAR drafter autoregressively: lossless but useless drafts
            raise RuntimeError(
                "falcon-vllm: the Falcon drafter is being run by vLLM's stock EAGLE drafting, so the "
                "plugin's proposer or speculator hook did not take effect (vLLM internals that moved; "
                "supported: vllm>=0.32,<0.34, its V1 runner or, in chain mode, its Model Runner V2)")
        if inputs_embeds is not None:
            raise NotImplementedError("falcon-vllm: the Falcon drafter does not take multimodal inputs")
        return self.model(input_ids, positions, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        ours = official_weights(self._split_head_weights(weights), keep_lm_head=self.truncated)
        loader = AutoWeightsLoader(self)
        loaded = loader.load_weights((name if name.startswith("lm_head.") else "model." + name, w) for name, w in ours)
        self._cast_gemms()
        return loaded
