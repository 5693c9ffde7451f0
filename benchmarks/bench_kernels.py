#!/usr/bin/env python
"""Tree-attention and KV-compaction kernels on verification shapes (GPU).

    python benchmarks/bench_kernels.py                      # full grid, needs a CUDA GPU
    python benchmarks/bench_kernels.py --batch 1 --width 128 --prefix 2048 --heads 7b
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke   # CPU: checks the script only

For every shape (heads x W x prefix x batch) it times, with ``triton.testing.do_bench`` (median,
L2 flushed between runs):

* ``tree``: :func:`falcon_vllm.kernels.tree_attention.tree_attention` reading the prefix through a
  paged block table (block size 16, physical blocks shuffled) and the tree under an ancestor mask;
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with an explicit boolean mask
  [B, 1, W, P + W] over K/V that are already dense and contiguous (it gets the gather for free);
* ``flash_attn`` when the package is installed: ``flash_attn_with_kvcache`` on the same paged
  cache with a *causal* mask (a chain, not a tree: a lower bound for what a tree needs).

and reports the KV-read bandwidth of the tree kernel: bytes of prefix K and V plus in-flight
q/k/v/out, divided by the time, as a fraction of the device's peak HBM bandwidth.  The tree of
width W is a random tree with W nodes (depth-first slot order, branching like the paper's trees).
``kv_compaction`` is timed moving an accepted path of 8 tokens per request in all layers.

Results go to ``benchmarks/results/<name>.{json,md}`` with the device named.  Without a GPU the
script says so and exits with status 2 (``--smoke`` runs two tiny shapes through the Triton
interpreter instead, to test the script; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from harness.paths import RESULTS

HEADS = {"7b": (32, 32, 128), "13b": (40, 40, 128), "gqa8": (32, 8, 128)}  # (Hq, Hkv, D)
PEAK_HBM = {"H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
            "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12, "A100": 1.555e12}


def peak_bandwidth(name: str) -> float | None:
    for key, bw in PEAK_HBM.items():
        if all(part in name for part in key.split()):
            return bw
    return None


def copy_bandwidth() -> float:
    """Measured ceiling: bytes read + written per second by a 1 GiB device-to-device copy."""
    x = torch.randn(2 ** 28, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), smoke=False)
    del x, y
    return 2 * 2 ** 28 * 4 / (ms * 1e-3)


def random_tree_parents(width: int, seed: int) -> torch.Tensor:
    """Parent indices of a random tree of ``width`` slots (slot 0 = root, parents precede children)."""
    g = torch.Generator().manual_seed(seed)
    parent = [-1]
    for i in range(1, width):
        # favour recent nodes: deep, paper-like trees rather than a flat star
        lo = max(0, i - 4)
        parent.append(int(torch.randint(lo, i, (1,), generator=g)))
    return torch.tensor(parent)


def make_case(B, W, P, Hq, Hkv, D, dtype, device, block_size=16, seed=0):
    from falcon_vllm.kernels.tree_attention import batch_tree_bits

    g = torch.Generator().manual_seed(seed)
    nblk = (P + block_size - 1) // block_size
    num_blocks = max(1, B * nblk)
    perm = torch.randperm(num_blocks, generator=g)
    block_table = perm[: B * nblk].view(B, nblk).to(torch.int32) if nblk else torch.zeros(B, 1, dtype=torch.int32)
    T = B * W

    gd = torch.Generator(device=device).manual_seed(seed)  # draw on the device: the caches are GBs

    def r(*shape):
        return torch.randn(*shape, generator=gd, device=device).to(dtype)

    q, k, v = r(T, Hq, D), r(T, Hkv, D), r(T, Hkv, D)
    kc, vc = r(num_blocks, block_size, Hkv, D), r(num_blocks, block_size, Hkv, D)
    parents = [random_tree_parents(W, seed + b) for b in range(B)]
    bits = batch_tree_bits(parents)
    qsl = torch.arange(0, T + 1, W, dtype=torch.int32)
    pl = torch.full((B,), P, dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return dict(q=q, k=k, v=v, key_cache=kc, value_cache=vc, block_table=to(block_table),
                prefix_lens=to(pl), query_start_loc=to(qsl), tree_bits=to(bits)), parents


def dense_inputs(case, parents, B, W, P):
    """Dense K/V [B, Hkv, P+W, D] and the boolean mask [B, 1, W, P+W] for SDPA."""
    from falcon_vllm.kernels.tree_attention import ancestor_mask_from_parents

    kc, vc, bt = case["key_cache"], case["value_cache"], case["block_table"]
    Hkv, D = kc.shape[2], kc.shape[3]
    Hq = case["q"].shape[1]
    nblk = bt.shape[1]
    kp = kc[bt.long()].reshape(B, nblk * kc.shape[1], Hkv, D)[:, :P]
    vp = vc[bt.long()].reshape(B, nblk * vc.shape[1], Hkv, D)[:, :P]
    K = torch.cat([kp, case["k"].view(B, W, Hkv, D)], 1).transpose(1, 2).contiguous()
    V = torch.cat([vp, case["v"].view(B, W, Hkv, D)], 1).transpose(1, 2).contiguous()
    Q = case["q"].view(B, W, Hq, D).transpose(1, 2).contiguous()
    mask = torch.ones(B, 1, W, P + W, dtype=torch.bool, device=Q.device)
    for b, par in enumerate(parents):
        mask[b, 0, :, P:] = ancestor_mask_from_parents(par).to(Q.device)
    return Q, K, V, mask


TIMING = {"graph": True}


def bench(fn, smoke: bool) -> float:
    """Median milliseconds.  On GPU the call is captured in a CUDA graph and its replays are timed
    (``--timing graph``, the default): that is how vLLM runs decode steps, and it keeps Python
    launch overhead (tens of microseconds per Triton launch) out of a kernel that runs for ~10 us."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton

    if TIMING["graph"]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()                     # compile and autotune outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def run_sweep(heads, B, W, P, dtype):
    """Time every tile configuration on one shape; returns rows sorted fastest first."""
    from falcon_vllm.kernels.tree_attention import default_config, tree_attention, tree_attention_ref

    Hq, Hkv, D = HEADS[heads]
    case, _ = make_case(B, W, P, Hq, Hkv, D, dtype, "cuda")
    ref = tree_attention_ref(**case, scale=D ** -0.5)
    rep = Hq // Hkv
    default = default_config(W, rep, D)
    rows = []
    for block_m in (16, 32, 64, 128):
        for splits in (None, 1, 2, 4, 8, 16):
            for warps in (4, 8):
                if block_m < rep:
                    continue
                cfg = {"block_m": block_m, "num_warps": warps}
                run = lambda: tree_attention(**case, scale=D ** -0.5, max_query_len=W,  # noqa: E731
                                             max_prefix_len=P, num_splits=splits, config=cfg)
                err = float((run().float() - ref.float()).abs().max())
                rows.append({"heads": heads, "batch": B, "width": W, "prefix": P, "block_m": block_m,
                             "num_splits": splits if splits else "auto", "num_warps": warps,
                             "is_default": splits is None and block_m == default["block_m"]
                             and warps == default["num_warps"], "ms": bench(run, False), "max_abs_err": err})
    return sorted(rows, key=lambda r: r["ms"])


def run_shape(heads, B, W, P, dtype, device, smoke, peak, config=None):
    from falcon_vllm.kernels.tree_attention import tree_attention, tree_attention_ref

    Hq, Hkv, D = HEADS[heads] if not smoke else (4, 2, 64)
    case, parents = make_case(B, W, P, Hq, Hkv, D, dtype, device)
    scale = D ** -0.5
    out = tree_attention(**case, scale=scale, max_query_len=W, max_prefix_len=P, config=config)
    ref = tree_attention_ref(**{k: v for k, v in case.items()}, scale=scale)
    err = float((out.float() - ref.float()).abs().max())
    row = {"heads": heads, "Hq": Hq, "Hkv": Hkv, "head_dim": D, "batch": B, "width": W, "prefix": P,
           "dtype": str(dtype).replace("torch.", ""), "max_abs_err_vs_ref": err}
    row["tree_ms"] = bench(lambda: tree_attention(**case, scale=scale, max_query_len=W, max_prefix_len=P,
                                                  config=config), smoke)
    elem = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * B * P * Hkv * D * elem
    io_bytes = B * W * (2 * Hq + 2 * Hkv) * D * elem
    row["kv_read_GBps"] = (kv_bytes + io_bytes) / (row["tree_ms"] * 1e-3) / 1e9
    row["frac_peak_hbm"] = (row["kv_read_GBps"] * 1e9 / peak) if peak else None
    Q, K, V, mask = dense_inputs(case, parents, B, W, P)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row["sdpa_ms"] = bench(lambda: sdpa(Q, K, V, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv), smoke)
    row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["tree_ms"]
    row["flash_attn_causal_ms"] = None
    try:
        from flash_attn import flash_attn_with_kvcache  # noqa: F401
    except ImportError:
        pass
    else:
        if device == "cuda" and dtype != torch.float32:
            qf = case["q"].view(B, W, Hq, D)
            seqlens = case["prefix_lens"].clone()
            row["flash_attn_causal_ms"] = bench(lambda: flash_attn_with_kvcache(
                qf, case["key_cache"], case["value_cache"], k=case["k"].view(B, W, Hkv, D),
                v=case["v"].view(B, W, Hkv, D), cache_seqlens=seqlens, block_table=case["block_table"],
                causal=True), smoke)
    return row


def run_compaction(B, layers, Hkv, D, dtype, device, smoke):
    from falcon_vllm.kernels.kv_compaction import kv_compaction, plane_table

    bs, A = 16, 8
    nblk = 4
    planes = [torch.randn(B * nblk, bs, Hkv, D).to(dtype).to(device) for _ in range(2 * layers)]
    table = plane_table(planes)
    base = torch.arange(B) * nblk * bs + 3
    src = (base[:, None] + 2 * torch.arange(A)[None, :] + 1).to(torch.int32).to(device)
    dst = (base[:, None] + torch.arange(A)[None, :]).to(torch.int32).to(device)
    ms = bench(lambda: kv_compaction(table, src.view(-1), dst.view(-1)), smoke)
    moved = 2 * (2 * layers) * B * A * Hkv * D * torch.tensor([], dtype=dtype).element_size()
    return {"batch": B, "layers": layers, "Hkv": Hkv, "head_dim": D, "accepted": A,
            "dtype": str(dtype).replace("torch.", ""), "ms": ms, "GBps": moved / (ms * 1e-3) / 1e9}


def to_markdown(res) -> str:
    lines = [f"# Kernel benchmark: {res['device']}", "", f"Command: `{res['command']}`", "", f"Timing: median of {res['timing']} (triton.testing.do_bench, L2 flushed)", "",
             f"Peak HBM bandwidth (datasheet): {res['peak_hbm_GBps']} GB/s; measured 1 GiB device copy "
             f"(read + write): {res['measured_copy_GBps'] and round(res['measured_copy_GBps'])} GB/s", "",
             "| heads | B | W | prefix | tree ms | SDPA+mask ms | speedup | KV GB/s | % peak | % copy | FA causal ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["tree_attention"]:
        pk = f"{100 * r['frac_peak_hbm']:.0f}%" if r["frac_peak_hbm"] else "n/a"
        cp = f"{100 * r['frac_measured_copy_bw']:.0f}%" if r["frac_measured_copy_bw"] else "n/a"
        fa = f"{r['flash_attn_causal_ms']:.3f}" if r["flash_attn_causal_ms"] else "-"
        lines.append(f"| {r['heads']} | {r['batch']} | {r['width']} | {r['prefix']} | {r['tree_ms']:.3f} | "
                     f"{r['sdpa_ms']:.3f} | {r['speedup_vs_sdpa']:.2f}x | {r['kv_read_GBps']:.0f} | {pk} | {cp} | {fa} |")
    lines += ["", "| compaction: B | layers | ms | GB/s |", "|---|---|---|---|"]
    for r in res["kv_compaction"]:
        lines.append(f"| {r['batch']} | {r['layers']} | {r['ms']:.3f} | {r['GBps']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="7b,13b", help=f"comma list of {sorted(HEADS)}")
    p.add_argument("--width", default="8,32,64,128,256", help="tree sizes W")
    p.add_argument("--prefix", default="512,2048,4096")
    p.add_argument("--batch", default="1,8,64")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--smoke", action="store_true", help="CPU: two tiny shapes under TRITON_INTERPRET=1")
    p.add_argument("--timing", default="graph", choices=["graph", "eager"],
                   help="GPU: time CUDA-graph replays (default) or eager calls (includes launch overhead)")
    p.add_argument("--config", default=None, help='GPU: tree_attention config override, JSON, e.g. \'{"prefetch": true}\'')
    p.add_argument("--sweep", action="store_true",
                   help="GPU: time every tile configuration (block_m, splits, warps) per shape instead")
    p.add_argument("--name", default=None, help="results name (default kernels_<device>)")
    p.add_argument("--out-dir", default=RESULTS)
    a = p.parse_args(argv)
    TIMING["graph"] = a.timing == "graph"
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        device, dtype = "cpu", torch.float32
        shapes = [("smoke", 2, 5, 20), ("smoke", 1, 8, 0)]
        dev_name, peak = f"CPU ({platform.processor() or platform.machine()}), Triton interpreter", None
        copy_bw = None
    else:
        if not torch.cuda.is_available():
            print("bench_kernels: no CUDA GPU here; the kernel timings need one (nothing written). "
                  "On CPU, `TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke` checks the script.",
                  file=sys.stderr)
            return 2
        device, dtype = "cuda", getattr(torch, a.dtype)
        dev_name = torch.cuda.get_device_name()
        peak = peak_bandwidth(dev_name)
        copy_bw = copy_bandwidth()
        shapes = [(h, B, W, P) for h in a.heads.split(",") for B in map(int, a.batch.split(","))
                  for W in map(int, a.width.split(",")) for P in map(int, a.prefix.split(","))]
    from tqdm import tqdm

    if a.sweep and not a.smoke:
        sweep = [run_sweep(h, B, W, P, dtype) for h, B, W, P in tqdm(shapes, desc="sweep", unit="shape")]
        name = a.name or "kernels_sweep"
        os.makedirs(a.out_dir, exist_ok=True)
        with open(os.path.join(a.out_dir, name + ".json"), "w") as f:
            json.dump({"device": dev_name, "timing": a.timing, "shapes": sweep}, f, indent=1)
        lines = [f"# Tile sweep: {dev_name} ({a.timing})", "",
                 "| heads | B | W | prefix | best ms | block_m | splits | warps | default ms |", "|---|---|---|---|---|---|---|---|---|"]
        for rows in sweep:
            b0, d0 = rows[0], next(r for r in rows if r["is_default"])
            lines.append(f"| {b0['heads']} | {b0['batch']} | {b0['width']} | {b0['prefix']} | {b0['ms']:.4f} | "
                         f"{b0['block_m']} | {b0['num_splits']} | {b0['num_warps']} | {d0['ms']:.4f} |")
        with open(os.path.join(a.out_dir, name + ".md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    rows = []
    for heads, B, W, P in tqdm(shapes, desc="tree attention", unit="shape"):
        try:
            rows.append(run_shape(heads, B, W, P, dtype, device, a.smoke, peak,
                                  json.loads(a.config) if a.config else None))
        except torch.OutOfMemoryError:
            tqdm.write(f"skip {heads} B={B} W={W} P={P}: out of GPU memory (SDPA's dense mask)")
            torch.cuda.empty_cache()
    for r in rows:
        r["frac_measured_copy_bw"] = r["kv_read_GBps"] * 1e9 / copy_bw if copy_bw else None
    comp = [run_compaction(B, 2 if a.smoke else 32, 2 if a.smoke else 32, 64 if a.smoke else 128, dtype,
                           device, a.smoke) for B in ([1, 2] if a.smoke else [1, 8, 64])]
    name = a.name or ("kernels_smoke" if a.smoke else "kernels_" + dev_name.replace(" ", "_").lower())
    res = {"device": dev_name, "torch": torch.__version__, "peak_hbm_GBps": peak / 1e9 if peak else None,
           "measured_copy_GBps": copy_bw / 1e9 if copy_bw else None,
           "timing": "cuda-graph replays" if TIMING["graph"] and not a.smoke else ("eager" if not a.smoke else "interpreter"),
           "command": "python " + " ".join(["benchmarks/bench_kernels.py"] + (argv if argv is not None else sys.argv[1:])),
           "config": json.loads(a.config) if a.config else None, "tree_attention": rows, "kv_compaction": comp}
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, name + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out_dir, name + ".md"), "w") as f:
        f.write(to_markdown(res))
    print(to_markdown(res))
    bad = [r for r in rows if r["max_abs_err_vs_ref"] > (1e-3 if dtype == torch.float32 else 2e-2)]
    if bad:
        print(f"bench_kernels: {len(bad)} shapes differ from the torch reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
