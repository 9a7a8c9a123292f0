"""Host memory handed back when the engine goes idle.

glibc's malloc keeps the pages a burst of work freed (PCM kept for word alignment, the aligner's
activations, decoded chunks) in its heap, fragmented between live blocks, and raises its mmap
threshold after large frees so that later large blocks land in the heap too: a server's RSS
then stays at its busiest moment's size long after the work is over. ``malloc_trim(0)`` returns
every free page of every arena to the kernel. The worker calls :func:`release_free_pages` once
it is idle after work (at most every ``MIN_INTERVAL_S``), never in the middle of it. No-op off glibc.
"""

from __future__ import annotations

import ctypes
import logging
import time

log = logging.getLogger("streamvox.worker")

MIN_INTERVAL_S = 2.0  # a trim walks the heap (milliseconds); idle moments between requests are frequent

try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    _malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):  # not glibc (musl, macOS)
    _malloc_trim = None


class IdleTrim:
    """Call :meth:`worked` after a step that did something, :meth:`idle` when there is nothing
    in flight: the free heap pages go back to the kernel once per idle spell after work."""

    def __init__(self, min_interval_s: float = MIN_INTERVAL_S):
        self.min_interval_s = min_interval_s
        self.pending = False  # work happened since the last trim
        self.last = 0.0

    def worked(self) -> None:
        self.pending = True

    def idle(self) -> None:
        now = time.monotonic()
        if not self.pending or now - self.last < self.min_interval_s:
            return
        self.pending = False
        self.last = now
        release_free_pages()


def release_free_pages() -> None:
    if _malloc_trim is not None:
        try:
            _malloc_trim(0)
        except OSError as exc:  # never fatal: memory is only not returned
            log.debug("malloc_trim failed: %s", exc)
