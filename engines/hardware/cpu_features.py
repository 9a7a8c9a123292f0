"""What this x86 CPU computes natively, read once from /proc/cpuinfo (empty elsewhere): the int8
kernels' activation range and the codec decoder's default precision depend on it. And how the
service splits its threads between the talker and the codec decoder, from a probe of this
machine's memory bandwidth at start (``plan_threads``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable

import torch


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


# --------------------------------------------------------------------------- threads, by measurement

PROBE_BYTES = 256 << 20  # read per bandwidth sample: eight times this machine type's 32 MiB L3
PROBE_REPEATS = 3  # best of: a neighbour's burst lowers a sample, never raises it
ENOUGH_BANDWIDTH = 0.9  # a thread count within this share of the best bandwidth measured is enough


@dataclass(frozen=True)
class ThreadPlan:
    """Torch intra-op threads for the talker (the worker thread, and ONNX Runtime's pool) and for
    the codec decoder (0: no thread of its own: it decodes on the worker thread after each tick)."""

    talker: int
    codec: int
    reason: str = ""


def read_bandwidth(threads: int, repeats: int = PROBE_REPEATS, nbytes: int = PROBE_BYTES) -> float:
    """GB/s that ``threads`` torch threads read from memory (a sum over a buffer far larger than
    the caches), the best of ``repeats``; the caller's thread count is restored."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer.sum()  # first touch, thread start-up
        best = min(_timed(buffer.sum) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def available_threads() -> int:
    """The threads the operator gave torch (OMP_NUM_THREADS, ``torch.set_num_threads``), at most
    the cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores))


def plan_threads(available: int, codec_fixed: int | None = None,
                 bandwidth: Callable[[int], float] = read_bandwidth) -> ThreadPlan:
    """The talker's and the codec decoder's threads out of ``available``, from a short probe.

    The talker (int8 or int4 weights read once per frame) is bound by memory bandwidth: it gets
    the fewest threads that read within 10 % of the best bandwidth any count up to ``available - 1``
    reaches (on a VM whose second core adds no bandwidth, one; a thread that adds none only waits
    with the others at each of the step's ~300 calls). The codec decoder, bound by arithmetic, gets
    the rest, or ``codec_fixed`` (a decoder whose rounding follows its thread count decodes on a
    fixed number: engines/pipelines/vocoder.py). One thread in all: no codec thread."""
    if available < 2:
        return ThreadPlan(available, 0, "1 thread: the codec decoder runs on the worker thread after each tick")
    rates = {t: bandwidth(t) for t in range(1, available)}  # at least one thread left for the codec
    best = max(rates.values())
    talker = min(t for t, rate in rates.items() if rate >= ENOUGH_BANDWIDTH * best)
    codec = codec_fixed if codec_fixed is not None else available - talker
    measured = ", ".join(f"{t} thread{'s' if t > 1 else ''} {rate:.1f} GB/s" for t, rate in rates.items())
    why_codec = (f"{codec} (fixed: its audio must not follow the thread count)" if codec_fixed is not None
                 else f"{codec} (the rest)")
    return ThreadPlan(talker, codec, f"memory read at {measured}: the talker takes {talker} "
                                     f"(within {1 - ENOUGH_BANDWIDTH:.0%} of the best), the codec decoder {why_codec}, "
                                     f"of {available} available")
