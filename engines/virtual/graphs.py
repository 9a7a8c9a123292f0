"""CUDA-graph captures on the virtual device: which buckets have a graph, and what a capture costs.

The engine captures its buckets at start (``capture_all``, before /readyz); a bucket first used
while serving is captured then, and the step waits for it: ``capture_ms`` of the host and the
device, counted in ``late_captures`` and logged as the real graphs log it
(engines/runtime/cuda_graphs.py ``BucketedGraphs``).
"""

from __future__ import annotations

import logging
from typing import Hashable, Iterable

from engines.virtual.clock import DeviceClock

log = logging.getLogger("streamvox.virtual")


class VirtualGraphs:
    def __init__(self, name: str, clock: DeviceClock, capture_ms: float, start_keys: Iterable[Hashable] = ()):
        self.name = name
        self.clock = clock
        self.capture_ms = capture_ms
        self.start_keys = tuple(start_keys)  # what capture_all captures (the real wrapper's start set)
        self.captured: set[Hashable] = set()
        self.serving = False
        self.captures = 0
        self.late_captures = 0

    def capture_all(self) -> None:
        """Engine start: the start set, costing no virtual time (start_s is the table's figure)."""
        self.captured.update(self.start_keys)
        self.captures += len(self.start_keys)
        self.serving = True

    def ensure(self, key: Hashable) -> None:
        """Capture ``key`` now if it has no graph (the step waits for it)."""
        if key in self.captured:
            return
        self.clock.blocking(self.capture_ms)
        self.captured.add(key)
        self.captures += 1
        if self.serving:
            self.late_captures += 1
            log.warning("captured the %s graph %s after start, on first use, in %.0f ms (virtual; every stream "
                        "waited for it)", self.name, key, self.capture_ms)


__all__ = ["VirtualGraphs"]
