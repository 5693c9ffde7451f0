"""The drafting core's chain program under a CUDA graph, with a stand-in drafter (a piece of ``gpu_check.py``).

``FalconDrafting.chain_program`` is Model Runner V2's chain step after its chunk pass: the relaxed block's inputs
gathered from the chunk rows and the stash, its pass, then ceil(K/k) - 1 block passes and the draws.  It reads
nothing on the host and its shapes follow from B, k and K, so one CUDA graph can hold a whole step.  Here it runs
with a stand-in drafter whose passes do what a drafter's do to memory: embed the block rows, write their K/V
through the pass's slot mapping (a padded slot writes to a sink row), read each row's previous position back
from the paged cache, and draw the argmax of a vocabulary head.

Checks, per batch size (the batch padded to a captured size with rows that have no request):

* the padded batch drafts what the unpadded one does and writes the same K/V, up to rounding (CPU and CUDA);
* CUDA: the step captured in one ``torch.cuda.CUDAGraph`` and replayed from the same state gives the eager step's
  drafts, K/V and stash exactly; the eager step's host syncs are counted (none allowed); eager and replayed
  times per step.
"""

from __future__ import annotations

import types

import torch

from falcon_vllm.core.drafting import FalconDrafting
from falcon_vllm.serving import Serving

PASSES = 3  # drafter passes of the step checked: it drafts K = PASSES * k tokens


class StandInDrafter(FalconDrafting):
    """The drafting core with a small torch drafter of hidden size H over a vocabulary of V tokens."""

    def __init__(self, k: int, B: int, H: int, V: int, num_blocks: int, block_size: int, dev, seed: int):
        g = torch.Generator(device=dev).manual_seed(seed)
        rows = 4 * B * k + 64
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.hidden_states = torch.zeros(rows, H, device=dev)
        self.device, self.block_size, self.max_model_len = torch.device(dev), block_size, num_blocks * block_size
        self.init_drafting(Serving(k=k))
        self.init_stash(B, H, dev, torch.float32, torch.int64)

        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, device=dev) * scale

        self.emb, self.head = randn(V, H), randn(H, V, scale=H ** -0.5)
        self.w1, self.w2 = randn(H, H, scale=H ** -0.5), randn(H, H, scale=H ** -0.5)
        self.sink, self.zero = num_blocks * block_size, num_blocks * block_size + 1
        self.kv = torch.cat([randn(num_blocks * block_size + 1, H), torch.zeros(1, H, device=dev)])
        self.randn = randn

    def _block_pass(self, ctx, ids, feats, positions, writes, extra_len):
        plan = self.plan_block(ctx.table, ids, feats, positions, writes)
        n = plan.num_rows
        x = self.hidden_states[:n] + self.emb[self.input_ids[:n]]
        self.kv.index_copy_(0, torch.where(plan.slot_mapping < 0, self.sink, plan.slot_mapping), x)
        prev = self.kv_slots(ctx.table, positions - 1)
        out = torch.tanh(x @ self.w1 + self.kv[torch.where(prev < 0, self.zero, prev)] @ self.w2)
        self.passes += 1
        return self.block_outputs(out, ids.shape[0])

    def _draft(self, rows, sampling, probs, conf):
        return (rows @ self.head).argmax(-1)

    def state(self) -> list[torch.Tensor]:
        """Every tensor a step changes."""
        s = self._stash
        return [self.kv, s.ids, s.feats, s.end_pos, s.num_valid, self.input_ids, self.positions, self.hidden_states]


def make_step(k: int, B: int, pad: int, H: int, V: int, dev, seed: int = 0, block_size: int = 16):
    """A stand-in drafter after one step (the stash holds each request's rows) and the next step's program, its
    batch of B requests padded by ``pad`` rows: (drafter, run) where run() drafts [B + pad, K]."""
    prefix = [5 + (37 * r) % 90 for r in range(B)]                     # each request's committed positions
    chunk = [1 + r % k for r in range(B)]                                # rows verified this step (< k: stash)
    nblk = [-(-(p + PASSES * k + 8) // block_size) for p in prefix]
    num_blocks = sum(nblk) + 1
    d = StandInDrafter(k, B, H, V, num_blocks, block_size, dev, seed)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(B + pad, max(nblk), dtype=torch.int64)
    start = 0
    for r in range(B):
        table[r, :nblk[r]] = perm[start:start + nblk[r]]
        start += nblk[r]
    table[B:] = perm.flip(0)[:max(nblk)]              # padded rows: stale rows naming live blocks
    ctx = types.SimpleNamespace(table=table.to(dev))
    req_ids = [f"req-{r}" for r in range(B)] + [None] * pad
    valid = (torch.arange(B + pad) < B).to(dev)

    def lay_out(counts, ends):
        """Each request's last ``counts`` rows up to position ``ends``, in EAGLE's shifted layout."""
        ids, pos = [], []
        for c, e in zip(counts, ends):
            pos += list(range(e - c + 1, e + 1))
            ids += [(7 * q + 3) % V for q in range(e - c + 2, e + 2)]
        n = len(pos)
        d.input_ids[:n] = torch.tensor(ids, device=dev)
        d.positions[:n] = torch.tensor(pos, device=dev)
        d.hidden_states[:n] = d.randn(n, H)
        qs = torch.tensor([0] + counts).cumsum(0)
        query_start = torch.cat([qs[:B], torch.zeros(pad, dtype=torch.long)]).to(dev)
        last = torch.cat([qs[1:] - 1, torch.zeros(pad, dtype=torch.long)]).to(dev)
        return query_start, last

    # step 1: each request's last k rows (the stash keeps k - 1 of them), K/V written
    first = [p - c for p, c in zip(prefix, chunk)]
    qs, last = lay_out([k] * B, first)
    d.chain_program(ctx, qs, last, d.step_slots(req_ids, dev), k, valid=valid)
    # step 2: `chunk` rows each; the relaxed block takes the others from the stash
    qs, last = lay_out(chunk, prefix)
    slots = d.step_slots(req_ids, dev)
    K = PASSES * k

    def run():
        return d.chain_program(ctx, qs, last, slots, K, valid=valid)

    return d, run


def check(ck, dev, quick: bool, timer) -> None:
    """The ``chain-graph`` piece for each batch size (gpu_check's Checker ``ck``; ``timer(fn, reps)``: CUDA ms)."""
    H, V, k = (64, 512, 2) if quick else (1024, 32000, 2)
    sizes = ((1, 1), (3, 5)) if quick else ((1, 1), (5, 8), (57, 64))
    cuda = dev.type == "cuda"
    for B, Bp in sizes:
        case = f"chain program k={k} K={PASSES * k} B={B} padded to {Bp} H={H} V={V}"
        box = {}

        def prepare(B=B, Bp=Bp):
            box["want"] = make_step(k, B, 0, H, V, dev)                 # unpadded, eager
            box["d"], box["run"] = make_step(k, B, Bp - B, H, V, dev)
            box["start"] = [t.clone() for t in box["d"].state()]

        def run():
            box["out"] = box["run"]()

        def check_():
            d, (want_d, want_run) = box["d"], box["want"]
            want = want_run()
            bad = []
            if not torch.equal(box["out"][:B], want):
                bad.append("padded drafts")
            if not torch.allclose(d.kv[:d.sink], want_d.kv[:want_d.sink], rtol=1e-4, atol=1e-4):
                bad.append("padded K/V")  # (a GEMM's rounding may depend on its row count)
            note = f"{PASSES} passes per step"
            if cuda:
                graph_ok, graph_note = capture_and_replay(box, ck.reps, timer)
                if not graph_ok:
                    bad.append("graph replay")
                note += "; " + graph_note
            if bad:
                note += "; wrong: " + ", ".join(bad)
            return dict(ok=not bad, note=note)

        ck.piece(case, "chain-graph", "cuda-graph" if cuda else "eager-padded", prepare, run, check_,
                 max_syncs=0)


def capture_and_replay(box, reps: int, timer) -> tuple[bool, str]:
    """Capture the step in one CUDA graph from the state it started in, replay it from there: the same drafts,
    K/V and stash as the eager run (``box``), and both times."""
    d, run, start = box["d"], box["run"], box["start"]
    eager_out, eager_state = box["out"].clone(), [t.clone() for t in d.state()]

    def restore():
        for t, s in zip(d.state(), start):
            t.copy_(s)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        for _ in range(2):
            restore()
            run()
    torch.cuda.current_stream().wait_stream(side)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    restore()
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(out, eager_out) and all(torch.equal(a, b) for a, b in zip(d.state(), eager_state))
    eager_ms, graph_ms = timer(run, reps), timer(graph.replay, reps)
    return same, f"eager {eager_ms:.3f} ms, graph {graph_ms:.3f} ms per step ({eager_ms / graph_ms:.2f}x)"

