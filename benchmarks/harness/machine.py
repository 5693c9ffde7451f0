"""The machine description every result carries (its ``machine`` field)."""

from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """CPU model and the vector extensions that matter to the GEMMs, e.g. 'AMD EPYC ..., AVX-512 (bf16)'."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name":
                    model = val.strip()
                elif key.strip() == "flags":
                    flags = set(val.split())
                    break
    except OSError:
        pass
    isa = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    if isa and "avx512_bf16" in flags:
        isa += " (bf16)"
    return f"{model}, {os.cpu_count()} CPUs" + (f", {isa}" if isa else "")
