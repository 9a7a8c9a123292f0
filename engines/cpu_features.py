"""What this x86 CPU computes natively, read once from /proc/cpuinfo (empty elsewhere): the int8
kernels' activation range and the codec decoder's default precision depend on it."""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_vnni() -> bool:
    """u8 x s8 products accumulate in int32 directly (VNNI or AMX); older x86 CPUs go through
    saturating int16 sums, which 7-bit activations keep in range."""
    return bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def has_native_bf16() -> bool:
    """bfloat16 dot products in hardware (AVX512-BF16 or AMX): oneDNN's bf16 convolutions then
    take about half the fp32 time; without them bf16 is emulated and slower than fp32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
