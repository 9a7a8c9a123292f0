"""PCM on its way to the host (vLLM's output side): each vocoder piece's audio goes into
pinned memory with an asynchronous copy plus an event, and is handed out, in order, once
that copy has completed - so issuing it never waits for the device.

At most ``max_in_flight`` pieces are outstanding (then the oldest is waited for), which
bounds how far the loop runs ahead of the GPU. On CPU the PCM is already on the host.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

MAX_IN_FLIGHT = 2  # vocoder pieces whose PCM may still be on its way to the host


@dataclass
class _Box:
    pcm: torch.Tensor  # host tensor (pinned on CUDA), all entries back to back
    event: "torch.cuda.Event | None"
    entries: list[tuple[Any, int]]  # (entry, samples) in delivery order

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.pcm.numpy()


class Outbox:
    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT):
        self.max_in_flight = max_in_flight
        self._boxes: deque[_Box] = deque()  # oldest first

    def __len__(self) -> int:
        return len(self._boxes)

    def put(self, pcm: list[torch.Tensor], entries: list[Any]) -> None:
        """Start the host copy of one piece's PCM (one 1-D tensor per entry, same order)."""
        if not entries:
            return
        flat = torch.cat([p.detach().reshape(-1).float() for p in pcm])
        sized = [(entry, p.numel()) for entry, p in zip(entries, pcm)]
        if flat.device.type != "cuda":
            self._boxes.append(_Box(flat, None, sized))
            return
        try:
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        except RuntimeError:  # no page-locked memory to be had: a synchronous copy still works
            self._boxes.append(_Box(flat.cpu(), None, sized))
            return
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._boxes.append(_Box(host, event, sized))

    def take(self, wait: bool = False) -> Iterator[tuple[Any, np.ndarray]]:
        """(entry, pcm) for every piece whose copy has completed, in order; ``wait``: all of them.
        Beyond ``max_in_flight`` outstanding pieces the oldest is waited for."""
        while self._boxes and (wait or len(self._boxes) > self.max_in_flight or self._boxes[0].ready()):
            box = self._boxes.popleft()
            pcm = box.wait()
            offset = 0
            for entry, size in box.entries:
                yield entry, pcm[offset:offset + size]
                offset += size
