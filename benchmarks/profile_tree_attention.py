#!/usr/bin/env python
"""Device time of each tree-attention launch (forward and split-KV combine) at batch 1, from the
torch profiler, for a few tile/split choices.  Needs a CUDA GPU.

    python benchmarks/profile_tree_attention.py
"""

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import HEADS, make_case  # noqa: E402

from falcon_vllm.kernels.tree_attention import tree_attention  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("profile_tree_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}: microseconds per launch (mean of 20)")
    for heads, W, P in (("7b", 128, 2048), ("gqa8", 32, 2048), ("7b", 32, 2048)):
        Hq, Hkv, D = HEADS[heads]
        case, _ = make_case(1, W, P, Hq, Hkv, D, torch.float16, "cuda")
        for cfg, splits in (({}, None), ({"combine_block_h": 16}, None), ({"combine_block_h": 4}, None),
                            ({"combine_block_h": 1}, None), ({}, 1), ({}, 2)):
            def call():
                return tree_attention(**case, scale=D ** -0.5, max_query_len=W, max_prefix_len=P,
                                      config=cfg, num_splits=splits)
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            times = {e.key[:20]: round(e.device_time_total / e.count, 1)
                     for e in prof.key_averages() if e.device_time_total > 0}
            print(f"{heads} B=1 W={W} P={P} config={cfg} splits={splits or 'auto'}: {times}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
