"""A virtual device timeline on the host's clock, like one CUDA stream.

    clock = DeviceClock()
    done = clock.graphed(16.1)      # a graph replay: queued behind what the stream still runs
    clock.eager(38.0)               # launch-bound eager work: the host is busy launching it
    done.query(); done.synchronize()   # a host read of the op's results: sleeps until it ended

A graphed op costs the host nothing: it starts when the stream is free (``max(now, free)``) and
ends its cost later, so the host runs ahead and later waits only where it reads results (the
talker reads the previous step's ids; the outbox waits on the PCM copy's event) - the overlap of
host and device work the real engine has. An eager op is launch bound (the table's prefill: the
same 35-44 ms for 9 or 102 positions): the host spends the op's cost launching it and the device
finishes with the last launch, or when its backlog drains if that is later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class DeviceEvent:
    """A point on the timeline: what ``torch.cuda.Event`` answers, for a virtual op."""

    clock: "DeviceClock"
    at: float  # host clock seconds at which the op ends

    def query(self) -> bool:
        return self.clock.now() >= self.at

    def synchronize(self) -> None:
        self.clock.sleep_until(self.at)


class DeviceClock:
    def __init__(self, now: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        self.now = now
        self._sleep = sleep
        self.free_at = 0.0  # when the stream has run everything queued
        self.busy_s = 0.0  # seconds in which the device had work
        self.waited_s = 0.0  # host seconds spent waiting on the device (reads, eager launches, captures)

    def graphed(self, ms: float) -> DeviceEvent:
        """Queue ``ms`` of device work; -> its end."""
        self._advance(max(self.now(), self.free_at) + ms / 1e3)
        return DeviceEvent(self, self.free_at)

    def eager(self, ms: float) -> DeviceEvent:
        """Launch ``ms`` of launch-bound work: the host is busy for ``ms``; -> its end."""
        end = self.now() + ms / 1e3
        self._advance(max(self.free_at, end))
        self.sleep_until(end)
        return DeviceEvent(self, self.free_at)

    def _advance(self, free_at: float) -> None:
        """The stream now runs until ``free_at``; the busy time counts each instant once."""
        self.busy_s += max(0.0, free_at - max(self.free_at, self.now()))
        self.free_at = free_at

    def blocking(self, ms: float) -> None:
        """Work the host drives synchronously once the stream has drained (a graph capture:
        warm-up and capture on a side stream that first waits for the main one)."""
        self.sleep_until(self.free_at)
        self.eager(ms)

    def record(self) -> DeviceEvent:
        """An event after everything queued so far (a copy's completion)."""
        return DeviceEvent(self, max(self.now(), self.free_at))

    def sleep_until(self, at: float) -> None:
        wait = at - self.now()
        if wait > 0:
            self.waited_s += wait
            self._sleep(wait)


__all__ = ["DeviceClock", "DeviceEvent"]
