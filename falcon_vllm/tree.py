"""Static decoding trees for semi-autoregressive (SAR) drafting.

A tree is a list of *rank paths*.  Path ``[r1, ..., rd]`` is a node at depth ``d``: its token is
candidate rank ``r1`` of the level-1 drafter row, then rank ``r2`` of the level-2 row under it,
and so on.  Every prefix of a path must be in the tree.  The root is implicit: it is the pending
token (the last token sampled by the target, not yet in its KV cache), at depth 0.

With block size ``k`` the drafter predicts ``k`` levels per forward pass (Falcon, Gao et al.,
AAAI 2025).  Pass 1 (the *chunk* pass over the newly accepted tokens) gives the candidate rows
for levels ``1..k``.  Pass ``q+1`` runs one ``k``-token block per *expansion node* at depth
``k*q`` (a node at that depth with descendants); the block's rows give levels
``k*q+1 .. k*q+k`` below that node.  ``k = 1`` gives an EAGLE-style static tree.

Unlike the official Falcon code we honour rank values (siblings are not renumbered) and reject
duplicate or orphan paths.

Slot numbering used by every engine: slot 0 is the root, slot ``i + 1`` is ``nodes[i]``; nodes are
sorted by ``(depth, path)``, so parents always precede children.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

Path = tuple[int, ...]


@dataclass(frozen=True)
class PassPlan:
    """What one drafter pass computes.

    Pass 1 has one block (the chunk's prediction block, ``expansion_slots == [0]``).  Pass q+1
    has one block per expansion node at depth ``k*q``.

    Attributes:
        expansion_slots: [n_blocks] slot of the node each block expands (0 = root).
        input_slots: [n_blocks, k] slots whose tokens are the block's input tokens (the k nodes on
            the expansion node's path at levels k(q-1)+1 .. kq); empty for pass 1.
        feature_rows: [n_blocks, k] rows of the *previous* pass's output whose predicted features
            are the block's input features; empty for pass 1.
        parent_block: [n_blocks] index, in the previous pass, of the block that produced this
            block's input (its ancestor block); -1 for pass 1.
        ancestor_blocks: [n_blocks, q - 1] for pass q+1: the block's ancestor in each earlier
            *tree* pass 2..q (the blocks whose K/V it attends to besides the prefix and itself);
            [1, 0] for pass 1.
    """

    expansion_slots: torch.Tensor
    input_slots: torch.Tensor
    feature_rows: torch.Tensor
    parent_block: torch.Tensor
    ancestor_blocks: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.expansion_slots.numel())


class DecodingTree:
    """A validated static decoding tree for block size ``k``.

    Args:
        paths: rank paths, e.g. ``[[0], [1], [0, 0]]``.  Order does not matter.
        k: drafter block size (tokens predicted per drafter pass), ``k >= 1``.
        name: optional label (preset name) used in logs and metrics.

    Raises:
        ValueError: empty tree, a path of depth 0, a negative or non-integer rank, a duplicate
            path, or a path whose prefix is missing.
    """

    def __init__(self, paths: Sequence[Sequence[int]], k: int, name: str | None = None):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"falcon-vllm: DecodingTree: block size k must be an integer >= 1, got {k!r}")
        paths = list(paths)
        if not paths:
            raise ValueError("falcon-vllm: DecodingTree: the tree has no paths; give at least one, e.g. [[0]]")
        seen: set[Path] = set()
        norm: list[Path] = []
        for p in paths:
            if isinstance(p, (int, str)) or not isinstance(p, Sequence):
                raise ValueError(f"falcon-vllm: DecodingTree: each path must be a list of ranks, got {p!r}")
            if len(p) == 0:
                raise ValueError("falcon-vllm: DecodingTree: a path of depth 0 (empty list) is not a node; "
                                 "the root is implicit")
            for r in p:
                if not isinstance(r, int) or isinstance(r, bool):
                    raise ValueError(f"falcon-vllm: DecodingTree: rank {r!r} in path {list(p)} is not an integer")
                if r < 0:
                    raise ValueError(f"falcon-vllm: DecodingTree: negative rank {r} in path {list(p)}")
            t = tuple(int(r) for r in p)
            if t in seen:
                raise ValueError(f"falcon-vllm: DecodingTree: duplicate path {list(t)}")
            seen.add(t)
            norm.append(t)
        for t in norm:
            if len(t) > 1 and t[:-1] not in seen:
                raise ValueError(f"falcon-vllm: DecodingTree: path {list(t)} has no parent {list(t[:-1])} "
                                 "(every prefix of a path must also be a path)")
        self.k = k
        self.name = name
        self.nodes: list[Path] = sorted(norm, key=lambda t: (len(t), t))
        self._slot = {t: i + 1 for i, t in enumerate(self.nodes)}
        self._slot[()] = 0
        self._draft_index: dict[str, list] = {}  # device -> the index tensors of draft() (built once)

    # ------------------------------------------------------------------ basic sizes
    @property
    def num_nodes(self) -> int:
        """Number of draft nodes (the root excluded)."""
        return len(self.nodes)

    @property
    def num_slots(self) -> int:
        """Tokens the target verifies per request: root + nodes."""
        return len(self.nodes) + 1

    @property
    def max_depth(self) -> int:
        return len(self.nodes[-1])

    @property
    def num_passes(self) -> int:
        """Drafter forward passes per round: ceil(max_depth / k)."""
        return math.ceil(self.max_depth / self.k)

    @property
    def is_chain(self) -> bool:
        return all(t == (0,) * len(t) for t in self.nodes)

    def slot_of(self, path: Sequence[int]) -> int:
        return self._slot[tuple(path)]

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return (f"DecodingTree({label}k={self.k}, nodes={self.num_nodes}, depth={self.max_depth}, "
                f"passes={self.num_passes})")

    # ------------------------------------------------------------------ per-slot tensors
    @cached_property
    def depth(self) -> torch.Tensor:
        """[num_slots] int64 depth of each slot (root 0).  Also the position offset from the root."""
        return torch.tensor([0] + [len(t) for t in self.nodes], dtype=torch.long)

    @property
    def position_offsets(self) -> torch.Tensor:
        """[num_slots] int64: absolute position = root position + offset."""
        return self.depth

    @cached_property
    def parent(self) -> torch.Tensor:
        """[num_slots] int64 parent slot of each slot (root: -1)."""
        return torch.tensor([-1] + [self._slot[t[:-1]] for t in self.nodes], dtype=torch.long)

    @cached_property
    def rank(self) -> torch.Tensor:
        """[num_slots] int64 candidate rank of each slot in its drafter row (root: -1)."""
        return torch.tensor([-1] + [t[-1] for t in self.nodes], dtype=torch.long)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[num_slots, num_slots] bool: ``mask[i, j]`` iff slot j is slot i or one of its ancestors.

        This is the attention mask among in-flight tree tokens (the committed prefix is visible to
        all of them).
        """
        n = self.num_slots
        m = torch.zeros(n, n, dtype=torch.bool)
        par = self.parent.tolist()
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j] = True
                j = par[j]
        return m

    @cached_property
    def children(self) -> list[list[int]]:
        """children[slot] = child slots in rank order (ascending rank)."""
        ch: list[list[int]] = [[] for _ in range(self.num_slots)]
        for i, t in enumerate(self.nodes):
            ch[self._slot[t[:-1]]].append(i + 1)
        for c in ch:
            c.sort(key=lambda s: self.nodes[s - 1][-1])
        return ch

    @cached_property
    def leaf_paths(self) -> torch.Tensor:
        """[num_leaves, max_depth] int64 slots of each root-to-leaf path (root excluded), -1 padded."""
        rows = []
        for i, t in enumerate(self.nodes):
            if not self.children[i + 1]:
                row = [self._slot[t[:d]] for d in range(1, len(t) + 1)]
                rows.append(row + [-1] * (self.max_depth - len(row)))
        return torch.tensor(rows, dtype=torch.long)

    # ------------------------------------------------------------------ drafting plan
    @cached_property
    def passes(self) -> list[PassPlan]:
        """The drafting plan: ``passes[p]`` is drafter pass p+1 (see :class:`PassPlan`)."""
        k = self.k
        plans = [PassPlan(expansion_slots=torch.tensor([0]),
                          input_slots=torch.zeros(1, 0, dtype=torch.long),
                          feature_rows=torch.zeros(1, 0, dtype=torch.long),
                          parent_block=torch.tensor([-1]),
                          ancestor_blocks=torch.zeros(1, 0, dtype=torch.long))]
        block_of: dict[Path, int] = {(): 0}  # expansion node -> block index in its pass
        for q in range(1, self.num_passes):
            exp = [t for t in self.nodes if len(t) == k * q and self.children[self._slot[t]]]
            exp_slots, inputs, frows, pblocks = [], [], [], []
            for j, t in enumerate(exp):
                anc = t[: k * (q - 1)]
                b = block_of[anc]
                exp_slots.append(self._slot[t])
                inputs.append([self._slot[t[:d]] for d in range(k * (q - 1) + 1, k * q + 1)])
                frows.append([b * k + r for r in range(k)])
                pblocks.append(b)
            for j, t in enumerate(exp):
                block_of[t] = j
            parent = torch.tensor(pblocks, dtype=torch.long)
            prev = plans[-1].ancestor_blocks
            chain = torch.cat([prev[parent], parent[:, None]], 1) if q > 1 else parent[:, None][:, :0]
            plans.append(PassPlan(expansion_slots=torch.tensor(exp_slots, dtype=torch.long),
                                  input_slots=torch.tensor(inputs, dtype=torch.long).view(-1, k),
                                  feature_rows=torch.tensor(frows, dtype=torch.long).view(-1, k),
                                  parent_block=parent, ancestor_blocks=chain))
        self._block_of = block_of
        return plans

    @cached_property
    def node_source(self) -> torch.Tensor:
        """[num_nodes, 3] int64: (pass index p (0-based), row in that pass's output, rank).

        Row ``b*k + r`` of pass p is level ``p*k + r + 1`` under block b of that pass.
        """
        self.passes  # builds _block_of
        k = self.k
        rows = []
        for t in self.nodes:
            d = len(t)
            p = (d - 1) // k
            anc = t[: k * p]
            rows.append([p, self._block_of[anc] * k + (d - 1) % k, t[-1]])
        return torch.tensor(rows, dtype=torch.long)

    def draft(self, rows: torch.Tensor, topk_fn, run_pass, return_outputs: bool = False):
        """SAR tree drafting by this plan, batched over B requests; every engine drafts through it.

        rows [B, k, H]: the first pass's output rows (levels 1..k).  ``topk_fn(rows [B, R, H])`` ->
        the drafter's top candidates [B, R, topk] (target ids, rank order).  ``run_pass(p, ids, feats,
        ancestors)`` runs tree pass p+1 (p >= 1) on ``ids`` [B, nb, k] / ``feats`` [B, nb, k, H] at
        depth offsets ``k*(p-1) + 0..k-1`` after the prefix, each block attending to its blocks
        ``ancestors`` [nb, p-1] of the earlier tree passes, and returns its rows [B, nb*k, H].
        Returns the node tokens [B, num_nodes] int64 (slot i+1 = column i), and with
        ``return_outputs`` each pass's output rows too.
        """
        index = self._draft_indices(rows.device)
        nodes = torch.zeros(rows.shape[0], self.num_nodes, dtype=torch.long, device=rows.device)
        outs, table = [rows], topk_fn(rows)                       # table [B, rows, topk]
        for p, (cols, src_rows, ranks, inputs, frows) in enumerate(index, start=1):
            nodes[:, cols] = table[:, src_rows, ranks]            # the nodes pass p's candidates fill
            if p == self.num_passes:
                break
            ids = nodes[:, inputs]                                                     # [B, nb, k]
            feats = outs[p - 1][:, frows]                                              # [B, nb, k, H]
            outs.append(run_pass(p, ids, feats, self.passes[p].ancestor_blocks))
            table = topk_fn(outs[-1])
        return (nodes, outs) if return_outputs else nodes

    def _draft_indices(self, device) -> list[tuple[torch.Tensor, ...]]:
        """Per drafter pass p (1-based): the node columns its candidates fill, their (row, rank) in its
        output, and the next pass's input node columns and feature rows; integer tensors made once per
        device, so drafting copies nothing to the device and never syncs on a boolean mask."""
        key = str(device)
        if key not in self._draft_index:
            src, out = self.node_source, []
            for p in range(1, self.num_passes + 1):
                cols = (src[:, 0] == p - 1).nonzero().squeeze(1)
                nxt = self.passes[p] if p < self.num_passes else None
                idx = (cols, src[cols, 1], src[cols, 2], None if nxt is None else nxt.input_slots - 1,
                       None if nxt is None else nxt.feature_rows)
                out.append(tuple(None if t is None else t.to(device) for t in idx))
            self._draft_index[key] = out
        return self._draft_index[key]

    @cached_property
    def topk(self) -> int:
        """Candidates needed per drafter row: 1 + the largest rank in the tree."""
        return 1 + max(t[-1] for t in self.nodes)

    def rows_per_pass(self) -> list[int]:
        return [pl.num_blocks * self.k for pl in self.passes]

    # ------------------------------------------------------------------ (de)serialisation
    def to_list(self) -> list[list[int]]:
        return [list(t) for t in self.nodes]

    def describe(self) -> dict:
        per_depth = [sum(1 for t in self.nodes if len(t) == d) for d in range(1, self.max_depth + 1)]
        return {"name": self.name, "k": self.k, "nodes": self.num_nodes, "depth": self.max_depth,
                "nodes_per_depth": per_depth, "drafter_passes": self.num_passes,
                "rows_per_pass": self.rows_per_pass(), "leaves": int(self.leaf_paths.shape[0])}


# ---------------------------------------------------------------------- tree files
@dataclass(frozen=True)
class TreeFile:
    """A tree file: a JSON list of rank paths, ``{"tree": paths}``, or a ``falcon-vllm tune-tree`` file
    (``{"paths": ..., "by_batch_size": {b: {"paths": ...}}, ...}``)."""
    tuned: bool                            # a tune-tree file (it has "paths" or "by_batch_size")
    paths: list | None                     # its main tree (the largest one: vLLM's K)
    by_batch_size: list[tuple[int, list]]  # (batch size, its tree's paths; [] = no speculation), ascending
    k: int | None = None                   # the drafter block size a tune-tree file was fitted for


def load_json(path: str):
    """A JSON file's content; invalid JSON gives one clear error."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"falcon-vllm: {path} is not valid JSON: {e}") from None


def read_tree_file(path: str) -> TreeFile:
    """Parse a tree file; any other JSON object gives an empty, untuned result.  A malformed one (paths that are not
    a list, ``by_batch_size`` not a map of batch sizes to ``{"paths": [...]}``, a batch size given twice or not a
    positive integer, a ``k`` that is not one) gives one error naming the file; the paths themselves are checked
    where the tree is built (:class:`DecodingTree`)."""
    data = load_json(path)
    bad = lambda what: ValueError(f"falcon-vllm: tree file {path}: {what}")  # noqa: E731
    if isinstance(data, list):
        return TreeFile(tuned=False, paths=data, by_batch_size=[])
    if not isinstance(data, dict):
        raise bad(f"expected a list of rank paths or a JSON object, got {type(data).__name__}")
    paths = data.get("paths", data.get("tree"))
    if paths is not None and not isinstance(paths, list):
        raise bad(f"'paths' must be a list of rank paths such as [[0], [1], [0, 0]], got {paths!r}")
    by, rows = data.get("by_batch_size") or {}, {}
    if not isinstance(by, dict):
        raise bad(f"'by_batch_size' must map batch sizes to {{\"paths\": [...]}}, got {type(by).__name__}")
    for b, r in by.items():
        if not (isinstance(b, str) and b.isdigit() and b == str(int(b)) and int(b) >= 1):
            raise bad(f"by_batch_size: batch size {b!r} is not a positive integer written plainly (e.g. \"4\")")
        got = r.get("paths") if isinstance(r, dict) else None
        if not (isinstance(r, dict) and (got is None or isinstance(got, list))):
            raise bad(f"by_batch_size[{b!r}] must be {{\"paths\": [...]}} (an empty list: no speculation), got {r!r}")
        rows[int(b)] = got or []
    k = data.get("k")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise bad(f"'k' (the drafter block size the trees were fitted for) must be an integer >= 1, got {k!r}")
    return TreeFile(tuned="paths" in data or "by_batch_size" in data, paths=paths, by_batch_size=sorted(rows.items()),
                    k=k)


# ---------------------------------------------------------------------- presets
# The official Falcon trees (FALCON_REFERENCE.md 4.5).  `kmask2_8layer_tree` lists [0,1,0,0]
# twice; it is kept once here.
def _paper_vicuna() -> list[list[int]]:
    d1 = [[i] for i in range(20)]
    d2 = [[0, i] for i in range(10)] + [[1, 0], [1, 1], [2, 0], [2, 1], [3, 0]]
    d3 = ([[0, 0, i] for i in range(10)] +
          [[0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [0, 3, 0], [1, 0, 0], [1, 0, 1], [2, 0, 0],
           [3, 0, 0]])
    d4 = ([[0, 0, 0, i] for i in range(10)] +
          [[0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 2, 0], [0, 1, 0, 0], [0, 1, 0, 1], [0, 1, 1, 0],
           [0, 2, 0, 0], [0, 2, 1, 0], [0, 3, 0, 0], [1, 0, 0, 0], [1, 0, 0, 1], [2, 0, 0, 0],
           [3, 0, 0, 0]])
    d5 = ([[0, 0, 0, 0, i] for i in range(10)] +
          [[0, 0, 0, 1, 0], [0, 0, 0, 1, 1], [0, 0, 0, 2, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0],
           [0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 3, 0, 0, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0],
           [3, 0, 0, 0, 0]])
    d6 = ([[0, 0, 0, 0, 0, i] for i in range(9)] +
          [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 2, 0], [0, 0, 0, 1, 0, 0],
           [0, 0, 0, 1, 1, 0], [0, 0, 0, 2, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0],
           [0, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0], [0, 3, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0],
           [2, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0]])
    d7 = ([[0, 0, 0, 0, 0, 0, i] for i in range(9)] +
          [[0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 2, 0], [0, 0, 0, 0, 1, 0, 0],
           [0, 0, 0, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0], [0, 0, 2, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0],
           [0, 2, 0, 0, 0, 0, 0], [0, 3, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0]])
    d8 = ([[0, 0, 0, 0, 0, 0, 0, i] for i in range(8)] +
          [[0, 0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 2, 0],
           [0, 0, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 2, 0, 0],
           [0, 0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0],
           [0, 0, 2, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0, 0, 0],
           [0, 3, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 0]])
    return d1 + d2 + d3 + d4 + d5 + d6 + d7 + d8


def _paper_llama() -> list[list[int]]:
    z = lambda n: [0] * n  # noqa: E731
    d1 = [[i] for i in range(20)]
    d2 = [[0, i] for i in range(11)] + [[1, i] for i in range(4)] + [[2, i] for i in range(4)]
    d3 = ([[0, 0, i] for i in range(7)] + [[0, 1, 0], [0, 2, 0], [0, 3, 0]] +
          [[0, 1, i] for i in range(3, 10)] + [[1, 0, 0], [2, 0, 0]])
    d4 = ([[0, 0, 0, i] for i in range(10)] +
          [[0, 1, 0, 0], [0, 2, 0, 0], [0, 3, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0]])
    d5 = ([z(4) + [i] for i in range(10)] +
          [[0, 0, 0, 1, 0], [0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 3, 0, 0, 0], [1] + z(4), [2] + z(4)])
    d6 = ([z(5) + [i] for i in range(4)] +
          [[0, 0, 0, 1, 0, 0], [0, 1] + z(4), [0, 2] + z(4), [0, 3] + z(4), [1] + z(5), [2] + z(5)])
    d7 = ([z(6) + [i] for i in range(4)] +
          [[0, 0, 0, 1, 0, 0, 0], [0, 1] + z(5), [0, 2] + z(5), [0, 3] + z(5), [1] + z(6), [2] + z(6)])
    d8 = ([z(7) + [i] for i in range(3)] +
          [[0, 0, 0, 1] + z(4), [0, 1] + z(6), [0, 2] + z(6), [0, 3] + z(6), [1] + z(7), [2] + z(7)])
    return d1 + d2 + d3 + d4 + d5 + d6 + d7 + d8


# a preset pattern (chain-N, tree-AxB..) is built only up to this size; serving takes at most
# schema.MAX_TREE_NODES of them, and says so
MAX_PATTERN_NODES = 4096


def chain_paths(length: int) -> list[list[int]]:
    if length < 1:
        raise ValueError(f"falcon-vllm: a chain needs length >= 1, got {length}")
    if length > MAX_PATTERN_NODES:
        raise ValueError(f"falcon-vllm: chain-{length} has {length} nodes, far more than a step can verify")
    return [[0] * d for d in range(1, length + 1)]


def full_tree_paths(widths: Sequence[int]) -> list[list[int]]:
    """Every combination: widths[d] children per node at depth d (e.g. [4, 2, 1])."""
    nodes, level = 0, 1
    for w in widths:
        level *= w
        nodes += level
        if nodes > MAX_PATTERN_NODES:
            name = "tree-" + "x".join(map(str, widths))
            raise ValueError(f"falcon-vllm: {name} has more than {MAX_PATTERN_NODES} nodes, far more than a step "
                             "can verify")
    out: list[list[int]] = []
    frontier: list[list[int]] = [[]]
    for w in widths:
        frontier = [p + [r] for p in frontier for r in range(w)]
        out += frontier
    return out


PRESETS = {
    "falcon-vicuna": _paper_vicuna,  # kmask2_8layer_tree (paper Fig. 5 skeleton), 165 nodes
    "falcon-llama": _paper_llama,    # kmask2_8layer_tree_3 (paper Fig. 6), 118 nodes
    # EAGLE-style k=1 trees: a small one that fits vLLM's per-step limits comfortably
    "eagle-small": lambda: full_tree_paths([4, 2, 1, 1]),
    "eagle-medium": lambda: full_tree_paths([6, 3, 2, 1, 1]),
}


def preset_names() -> list[str]:
    return sorted(PRESETS) + ["chain-<N>", "tree-<w1>x<w2>x..."]


def preset_list() -> str:
    """The presets as the docs list them: each named preset with its node count, then the patterns."""
    return ", ".join([f"`{name}` {len(PRESETS[name]())} nodes" for name in sorted(PRESETS)]
                     + [f"`{name}`" for name in preset_names()[len(PRESETS):]])


def build_tree(spec, k: int) -> DecodingTree:
    """Build a tree from a preset name, a JSON/Python list string, a list of paths, or a file.

    Accepted specs: ``"falcon-vicuna"``, ``"falcon-llama"``, ``"eagle-small"``, ``"chain-5"``,
    ``"tree-4x2x1"`` (full tree with those widths per depth), a path to a JSON file holding a list
    of paths (or ``{"paths": [...]}``), a literal list string ``"[[0],[1],[0,0]]"``, or a list.
    """
    if isinstance(spec, DecodingTree):
        if spec.k != k:
            return DecodingTree(spec.to_list(), k, spec.name)
        return spec
    if isinstance(spec, (list, tuple)):
        return DecodingTree(spec, k)
    if not isinstance(spec, str):
        raise ValueError(f"falcon-vllm: tree must be a preset name, a list of paths or a file, got {spec!r}")
    s = spec.strip()
    if s in PRESETS:
        return DecodingTree(PRESETS[s](), k, s)
    if s.startswith("chain-") and s[6:].isdigit():
        return DecodingTree(chain_paths(int(s[6:])), k, s)
    if s.startswith("tree-"):
        try:
            widths = [int(w) for w in s[5:].split("x")]
        except ValueError:
            widths = []
        if widths and all(w >= 1 for w in widths):
            return DecodingTree(full_tree_paths(widths), k, s)
    if s.startswith("["):
        try:
            paths = json.loads(s)
        except json.JSONDecodeError:
            try:
                paths = ast.literal_eval(s)
            except (ValueError, SyntaxError) as e:
                raise ValueError(f"falcon-vllm: tree: cannot parse {s[:60]!r} as a list of paths: {e}") from None
        return DecodingTree(paths, k)
    import os
    if os.path.isfile(s):
        return DecodingTree(read_tree_file(s).paths or [], k, os.path.basename(s))
    raise ValueError(f"falcon-vllm: unknown tree {spec!r}; use a preset ({', '.join(preset_names())}), a list of "
                     "rank paths such as [[0],[1],[0,0]], or a JSON file of paths")
