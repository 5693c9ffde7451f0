"""The Falcon drafter as a vLLM model (``EagleFalconForCausalLM``).

It follows vLLM's EAGLE-1 drafter contract (``forward(input_ids, positions, hidden_states) ->
(h, h)``, shared embedding and LM head, attention layers numbered after the target's so they get
their own draft KV cache) and replaces EAGLE's ``fc`` by Falcon's fusion: the official 2-layer LSTM
applied per position (``lstm``) or a Linear (``fc``).  It loads falcon-vllm checkpoints and
official Falcon state dicts (``embed_tokens.*`` is dropped: the target's embedding is shared).

Whether a pass is causal (chunk pass) or sees its whole k-block (SAR block passes) is decided by
the attention metadata the proposer builds, not by this module.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.llama_eagle import LlamaDecoderLayer
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

from falcon_vllm.drafter import PositionwiseLSTM


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

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, hidden_states):
        x = torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1)  # [T, 2H], embedding first
        h = self.lstm(x[None])[0] if self.fusion == "lstm" else self.fc(x)
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        h = h + residual  # no final norm (Falcon/EAGLE)
        return h, h

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)


class EagleFalconForCausalLM(LlamaForCausalLM):
    """vLLM drafter for Falcon; the name starts with ``Eagle`` so vLLM's EAGLEConfig keeps it."""

    # our checkpoints never store these: vLLM shares the target's embedding and LM head
    has_own_embed_tokens = False
    has_own_lm_head = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        if getattr(self.config, "draft_vocab_size", None) is None:
            self.config.draft_vocab_size = self.config.vocab_size
        target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.model = FalconDraftModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                      start_layer_id=target_layers)
        self.logits_processor = LogitsProcessor(self.config.vocab_size,
                                                scale=getattr(self.config, "logit_scale", 1.0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def attach_falcon_proposer(self) -> None:
        """Called by FalconProposer.load_model: the proposer that runs this drafter is Falcon's."""
        self._falcon_proposer = True

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        if not getattr(self, "_falcon_proposer", False):
            # stock EAGLE would run a SAR drafter autoregressively: lossless but useless drafts
            raise RuntimeError(
                "falcon-vllm: the Falcon drafter is being run by vLLM's stock EAGLE proposer, so the "
                "plugin's proposer hook did not take effect (a V2 model runner, or vLLM internals that "
                "moved; supported: vllm>=0.32,<0.34 with the V1 runner, VLLM_USE_V2_MODEL_RUNNER=0)")
        if inputs_embeds is not None:
            raise NotImplementedError("the Falcon drafter does not take multimodal inputs")
        return self.model(input_ids, positions, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        def rename(items):
            for name, w in items:
                if name.startswith("model."):
                    name = name[len("model."):]
                if name.startswith(("embed_tokens.", "lm_head.")):
                    continue  # official checkpoints carry a copy of the target's; we share the target's
                yield "model." + name, w

        loader = AutoWeightsLoader(self)
        return loader.load_weights(rename(weights))
