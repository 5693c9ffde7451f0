#!/usr/bin/env python
"""Study: What does the rewritten CPU tree attention cost per layer against the previous code?

Answer: 0.33-0.64x the previous code per layer up to 32 rows and 0.88-0.93x at 119 rows.
Result: benchmarks/results/cpu_tree_attention.md

Per-layer time of the target's CPU tree attention (``VerifyTreeAttention`` serving the whole batch over
CPU_ATTN's paged cache), optionally against another checkout's, both in this process, calls alternating.

The cache is laid out and filled as vLLM's CPU backend leaves it before attention: the committed prefix
and this step's K/V in their slots (via ``paged_kv``'s view of the layout).  Half the requests carry a
tree of W nodes (root first), the other half a short causal query, so the batch is padded as in serving.
Every result is checked against ``tree_attention_ref``.  SmolLM2-135M's heads (9 query, 3 KV, head dim 64).

  python benchmarks/studies/cpu_tree_attention.py --shapes 1x3x250,1x16x300,1x119x300,4x4x300,4x119x300,16x4x300 \\
      --compare <checkout of an older commit> --name cpu_tree_attention
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import time
import types

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the harness
from harness.paths import RESULTS  # noqa: E402
from harness.report import write_report  # noqa: E402

H, HKV, D = 9, 3, 64


def load_tree_verify(checkout: str | None):
    """This tree's ``tree_verify`` module, or another checkout's (loaded from its file, on this tree's imports)."""
    if checkout is None:
        from falcon_vllm.vllm import tree_verify
        mod = tree_verify
    else:
        spec = importlib.util.spec_from_file_location("tree_verify_other",
                                                      os.path.join(checkout, "falcon_vllm", "vllm", "tree_verify.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    mod.kv_layout = lambda impl, layer=None: "cpu"  # the impl below is a stand-in of CPU_ATTN's
    return mod


def make_case(B: int, W: int, P: int, bs: int, seed: int = 0):
    from falcon_vllm.kernels.tree_attention import causal_tree_bits, tree_bits_from_parents
    from falcon_vllm.core.paged_kv import paged_kv

    g = torch.Generator().manual_seed(seed)
    words = (W + 31) // 32
    widths = [W if b % 2 == 0 else 1 + b % 3 for b in range(B)]          # odd requests: short causal queries
    parents = ([-1, 0, 0] + list(range(1, W - 2)))[:W] if W >= 3 else list(range(-1, W - 1))
    bits = torch.cat([tree_bits_from_parents(torch.tensor(parents), words) if b % 2 == 0
                      else causal_tree_bits(w, words) for b, w in enumerate(widths)])
    plens = torch.tensor([max(P - 7 * b, 1) for b in range(B)], dtype=torch.int32)
    need = (P + W + bs - 1) // bs
    kv = torch.randn(B * need + 1, HKV, bs, 2 * D, generator=g)
    kc, vc = paged_kv(kv, "cpu")
    table = torch.randperm(B * need, generator=g).view(B, need).int()
    qsl = np.concatenate([[0], np.cumsum(widths)])
    T = int(qsl[-1])
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, HKV, HKV))
    for b in range(B):  # vLLM writes the step's K/V into their slots before attention
        pos = int(plens[b]) + torch.arange(widths[b])
        blk, off = table[b].long()[pos // bs], pos % bs
        kc[blk, off], vc[blk, off] = k[qsl[b]:qsl[b + 1]], v[qsl[b]:qsl[b + 1]]
    seq = plens + torch.tensor(widths, dtype=torch.int32)
    md = types.SimpleNamespace(seq_lens=seq, block_table=table, max_seq_len=int(seq.max()))
    return dict(q=q, k=k, v=v, kv=kv, kc=kc, vc=vc, md=md, qsl=qsl, bits=bits, plens=plens, table=table, T=T)


def forward(mod, c, layers: int, out: torch.Tensor):
    impl = types.SimpleNamespace(scale=D ** -0.5)
    layer = types.SimpleNamespace(isa="vec")
    att = mod.VerifyTreeAttention(None, None, c["qsl"], c["bits"], "cpu", whole=True)  # one per forward
    for _ in range(layers):
        att.attend(impl, layer, c["q"], c["k"], c["v"], c["kv"], c["md"], out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1x3x250,1x16x300,1x119x300,4x4x300,4x119x300,16x4x300",
                   help="BxWxP: requests, tree rows (root included), committed prefix")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=30, help="layers per timed forward (the plan is built once)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--compare", default=None, help="checkout of another commit, timed side by side")
    p.add_argument("--name", default="cpu_tree_attention")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as vLLM's CPU worker runs (one OpenMP thread bound to a core)
    from falcon_vllm.kernels.tree_attention import tree_attention_ref

    versions = {"this": load_tree_verify(None)}
    if args.compare:
        versions = {"other": load_tree_verify(args.compare), **versions}
    rows = []
    for shape in args.shapes.split(","):
        B, W, P = (int(x) for x in shape.split("x"))
        c = make_case(B, W, P, args.block_size)
        ref = tree_attention_ref(c["q"], c["k"], c["v"], c["kc"], c["vc"], c["table"], c["plens"],
                                 torch.as_tensor(c["qsl"], dtype=torch.int32), c["bits"], D ** -0.5)
        secs = {n: [] for n in versions}
        for name, mod in versions.items():
            out = torch.zeros(c["T"], H * D)
            forward(mod, c, 1, out)
            err = float((out.view(c["T"], H, D) - ref).abs().max())
            if err > 1e-4:
                raise SystemExit(f"{name} at {shape}: max error {err} against tree_attention_ref")
        for _ in range(args.repeats):
            for name, mod in versions.items():
                t0 = time.perf_counter()
                forward(mod, c, args.layers, out)
                secs[name].append((time.perf_counter() - t0) / args.layers)
        row = {"B": B, "W": W, "P": P, **{f"{n}_us": statistics.median(s) * 1e6 for n, s in secs.items()}}
        if args.compare:
            row["this_over_other"] = row["this_us"] / row["other_us"]
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    cmd = "python benchmarks/studies/cpu_tree_attention.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.compare:
        cmd = cmd.replace(args.compare, "<checkout of the older commit>")
    cols = ["other_us", "this_us", "this_over_other"] if args.compare else ["this_us"]
    lines = [f"# CPU tree attention per layer: {args.name}", "", f"Command: `{cmd}`", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, one thread; median of {args.repeats} forwards of "
             f"{args.layers} layers, versions alternating; microseconds per layer.", "",
             "| B | W | P | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for r in rows:
        lines.append(f"| {r['B']} | {r['W']} | {r['P']} | " + " | ".join(
            f"{r[c]:.2f}x" if c == "this_over_other" else f"{r[c]:.0f}" for c in cols) + " |")
    write_report(RESULTS, args.name,
                 {"command": cmd, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "rows": rows}, lines)


if __name__ == "__main__":
    main()
