"""Reference engine: Falcon speculative generation on a Hugging Face target (batch size 1).

This is the oracle the tests and the vLLM integration are checked against, and the path for GPU
timing where vLLM is not installed.  One round (the paper's structure, FALCON_REFERENCE.md §4):

1. drafter chunk pass over the newly committed positions (relaxed mask, last k positions form one
   block) -> candidate rows for tree levels 1..k;
2. ``ceil(depth/k) - 1`` SAR tree passes: one k-token block per expansion node, attending to the
   drafter's prefix, its ancestor blocks and itself;
3. one target pass over ``[pending token] + tree nodes`` at positions ``n + depth`` under the
   ancestor mask;
4. verification (greedy or lossless sampling, :mod:`falcon_vllm.verify`);
5. K/V compaction: the accepted path's target K/V is moved next to the prefix, the rest dropped.

State between rounds: ``n`` committed tokens ``x_0..x_{n-1}`` (in the target's KV cache), the
pending token ``x_n`` (sampled by the target, not yet in its cache) and the target features
``f_0..f_{n-1}``.  Drafter position j reads ``(x_{j+1}, f_j)``, so it has n positions too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from falcon_vllm.drafter import FalconDrafter, chunk_mask
from falcon_vllm.tree import DecodingTree, build_tree
from falcon_vllm.verify import greedy_verify, probs_from_logits, sample_verify


@dataclass
class RoundStats:
    accepted: int         # draft tokens accepted this round (bonus excluded)
    drafter_passes: int   # drafter forward passes spent drafting this round's tree
    tree_nodes: int       # draft tokens verified


@dataclass
class GenerationResult:
    tokens: list[int]                       # generated tokens (prompt excluded)
    rounds: list[RoundStats] = field(default_factory=list)
    prompt_len: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target verification step, bonus included."""
        return 1.0 + sum(r.accepted for r in self.rounds) / max(1, len(self.rounds))

    @property
    def accept_lengths(self) -> list[int]:
        return [r.accepted for r in self.rounds]


class DrafterCache:
    """Drafter KV cache for committed positions: per layer (K, V) [1, nkv, m, hd]."""

    def __init__(self, num_layers: int):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.num_layers = num_layers

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[2]

    def crop(self, m: int):
        if self.kv is not None:
            self.kv = [(k[:, :, :m], v[:, :, :m]) for k, v in self.kv]

    def append(self, new):
        self.kv = new if self.kv is None else [(torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                                               for (k, v), (nk, nv) in zip(self.kv, new)]


class FalconReferenceEngine:
    """Falcon speculative decoding on a HF Llama/Qwen2 causal LM.

    Args:
        target: a transformers ``*ForCausalLM`` (eval mode).
        drafter: a :class:`FalconDrafter` for this target.
        tree: a :class:`DecodingTree`, a preset name or a list of paths (default: the drafter's
            configured tree, else a chain of length 2k).
    """

    def __init__(self, target, drafter: FalconDrafter, tree=None):
        self.target = target.eval()
        self.drafter = drafter.eval()
        self.drafter.config.check_target(target.config)
        if drafter.config.aux_layers:
            raise ValueError("falcon-vllm: the reference engine feeds the drafter the target's final hidden states "
                             f"only; this drafter also reads target layers {list(drafter.config.aux_layers)}")
        self.drafter.attach_target(target.get_input_embeddings(), target.get_output_embeddings())
        k = drafter.config.k
        spec = tree if tree is not None else (drafter.config.tree or f"chain-{2 * k}")
        self.tree: DecodingTree = build_tree(spec, k)
        self.k = k
        self._ancestor_mask = self.tree.ancestor_mask
        self._depth = self.tree.depth

    # ------------------------------------------------------------------ target
    def _target_forward(self, ids, positions, cache, tree_mask=None):
        """ids/positions [1, T]; tree_mask [T, P+T] bool or None (causal).  -> (features, logits) [T, .]."""
        mask = None
        if tree_mask is not None:
            dtype = self.target.get_input_embeddings().weight.dtype
            mask = torch.zeros(tree_mask.shape, dtype=dtype)
            mask.masked_fill_(~tree_mask, torch.finfo(dtype).min)
            mask = mask[None, None]
        out = self.target.base_model(input_ids=ids, position_ids=positions, past_key_values=cache,
                                     attention_mask=mask, use_cache=True)
        h = out.last_hidden_state[0]  # post final norm
        return h, self.target.get_output_embeddings()(h)

    @staticmethod
    def _compact_cache(cache, keep: torch.Tensor):
        """Keep only positions ``keep`` (in order) of every layer of a transformers DynamicCache."""
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(2, keep)
            layer.values = layer.values.index_select(2, keep)

    # ------------------------------------------------------------------ drafter
    def _chunk_pass(self, st: DrafterCache, tokens: list[int], feats: torch.Tensor):
        """Drafter pass over the positions not yet in its cache; returns the last block [k, H].

        ``tokens`` = committed tokens + pending (length n+1); ``feats`` = f_0..f_{n-1} [n, H].
        When fewer than k positions are new, the last k are recomputed (their cache is dropped).
        """
        k, n = self.k, feats.shape[0]
        s = max(0, min(st.length, n - k))
        st.crop(s)
        ids = torch.tensor(tokens[s + 1: n + 1])[None]
        f = feats[s:n][None]
        pos = torch.arange(s, n)[None]
        pad = max(0, k - n)  # prompts shorter than k: zero-feature virtual positions in front
        if pad:
            ids = torch.cat([ids.new_full((1, pad), tokens[0]), ids], 1)
            f = torch.cat([f.new_zeros(1, pad, f.shape[-1]), f], 1)
            pos = torch.cat([pos.new_zeros(1, pad), pos], 1)
        T = ids.shape[1]
        out, kv = self.drafter(self.drafter.embed(ids), f, pos, chunk_mask(s, T, k), st.kv)
        st.append([(kk[:, :, pad:], vv[:, :, pad:]) for kk, vv in kv])
        return out[0, -k:]

    def _draft(self, st: DrafterCache, tokens: list[int], feats: torch.Tensor, return_outputs: bool = False):
        """Draft the whole tree (:meth:`DecodingTree.draft`); returns node tokens [N] int64 (and each
        pass's output rows [rows, H])."""
        k, n = self.k, feats.shape[0]
        rows = self._chunk_pass(st, tokens, feats)  # [k, H]
        block_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per tree pass, per layer [nb, ...]

        def run_pass(p, ids, feats_in, ancestors):
            nb = ids.shape[1]
            pos = (n + k * (p - 1) + torch.arange(k)).expand(nb, k)
            # past = committed prefix + this block's ancestor blocks from earlier tree passes
            past = []
            for li, (K, V) in enumerate(st.kv):
                ks = [K.expand(nb, -1, -1, -1)] + [block_kv[j][li][0][ancestors[:, j]] for j in range(len(block_kv))]
                vs = [V.expand(nb, -1, -1, -1)] + [block_kv[j][li][1][ancestors[:, j]] for j in range(len(block_kv))]
                past.append((torch.cat(ks, 2), torch.cat(vs, 2)))
            mask = torch.ones(k, past[0][0].shape[2] + k, dtype=torch.bool)
            out, kv = self.drafter(self.drafter.embed(ids[0]), feats_in[0], pos, mask, past)
            block_kv.append(kv)
            return out.reshape(1, nb * k, -1)                              # row b*k + r

        topk = lambda r: self.drafter.topk_tokens(r[0], self.tree.topk)[None]  # noqa: E731
        nodes, outs = self.tree.draft(rows[None], topk, run_pass, return_outputs=True)
        return (nodes[0], [o[0] for o in outs]) if return_outputs else nodes[0]

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | list[int] | None = None, seed: int | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (stops after an EOS)."""
        from transformers import DynamicCache

        if not prompt_ids:
            raise ValueError("falcon-vllm: generate: the prompt is empty")
        max_pos = getattr(self.target.config, "max_position_embeddings", None)
        need = len(prompt_ids) + max_new_tokens + self.tree.max_depth + 1
        if max_pos is not None and need > max_pos:
            raise ValueError(f"falcon-vllm: prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) + tree "
                             f"depth ({self.tree.max_depth}) exceeds the target's context ({max_pos})")
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        greedy = temperature == 0.0

        def pick(logits_row):  # sample/argmax the next token from one logits row [V]
            if greedy:
                return int(logits_row.argmax())
            p = probs_from_logits(logits_row[None].float(), temperature, top_k, top_p)[0]
            return int(torch.multinomial(p, 1, generator=gen))

        cache = DynamicCache(config=self.target.config)
        tokens = list(prompt_ids)
        n = len(tokens)
        feats, logits = self._target_forward(torch.tensor([tokens]), torch.arange(n)[None], cache)
        tokens.append(pick(logits[-1]))  # pending token x_n
        st = DrafterCache(len(self.drafter.layers))
        result = GenerationResult(tokens=[], prompt_len=n)
        tree = self.tree
        while True:
            new = tokens[len(prompt_ids):]
            if len(new) >= max_new_tokens or eos.intersection(new):
                break
            node_tokens = self._draft(st, tokens, feats)
            n = feats.shape[0]
            ids = torch.cat([torch.tensor([tokens[-1]]), node_tokens])[None]          # [1, 1+N]
            pos = (n + self._depth)[None]
            mask = torch.cat([torch.ones(tree.num_slots, n, dtype=torch.bool), self._ancestor_mask], 1)
            h, lg = self._target_forward(ids, pos, cache, mask)
            if greedy:
                res = greedy_verify(tree, node_tokens[None], lg[None])
            else:
                res = sample_verify(tree, node_tokens[None], lg[None].float(), temperature, top_k, top_p,
                                    generator=gen)
            path = res.accepted_slots[0]
            keep_slots = torch.tensor([0] + path, dtype=torch.long)
            self._compact_cache(cache, torch.cat([torch.arange(n), n + keep_slots]))
            feats = torch.cat([feats, h[keep_slots]])
            tokens += node_tokens[keep_slots[1:] - 1].tolist() + [int(res.bonus_tokens[0])]
            result.rounds.append(RoundStats(len(path), tree.num_passes, tree.num_nodes))
        new = tokens[len(prompt_ids):][:max_new_tokens]
        for i, t in enumerate(new):
            if t in eos:
                new = new[: i + 1]
                break
        result.tokens = new
        return result


def drafter_passes_for_chain(K: int, k: int) -> int:
    return math.ceil(K / k)
