"""The output side (vLLM's ``update_from_output()``): each vocoder piece's PCM goes into
pinned memory with an asynchronous copy plus an event, and is handed out, in order, once
that copy has completed - so issuing it never waits for the device; then it becomes
:class:`engines.contract.AudioChunk` deliveries.

At most ``max_in_flight`` pieces are outstanding (then the oldest is waited for), which
bounds how far the loop runs ahead of the GPU. On CPU the PCM is already on the host.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from engines.contract import (
    SAMPLE_RATE,
    Alignment,
    AudioChunk,
    ChunkTiming,
    Deliver,
    RequestHandle,
)

if TYPE_CHECKING:
    from engines.core.scheduler import RequestState

log = logging.getLogger("streamvox.worker")

MAX_IN_FLIGHT = 2  # vocoder pieces whose PCM may still be on its way to the host


@dataclass
class _Box:
    pcm: torch.Tensor | list[torch.Tensor]  # host tensor (pinned on CUDA), all entries back to back; or one per entry
    event: Any  # torch.cuda.Event, a virtual device's event, or None (ready)
    entries: list[tuple[Any, int]]  # (entry, samples) in delivery order

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> list[np.ndarray]:
        """Each entry's PCM (the copy waited for)."""
        if self.event is not None:
            self.event.synchronize()
        if isinstance(self.pcm, list):
            return [p.numpy() for p in self.pcm]
        flat, offset, out = self.pcm.numpy(), 0, []
        for _, size in self.entries:
            out.append(flat[offset:offset + size])
            offset += size
        return out


class Outbox:
    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT, host_copy_event: Callable[[], Any] | None = None):
        self.max_in_flight = max_in_flight
        # For PCM already on the host: an event (``query``/``synchronize``) that says when its copy
        # would have landed; a virtual device's clock gives one (engines/virtual/). None: at once.
        self.host_copy_event = host_copy_event
        self._boxes: deque[_Box] = deque()  # oldest first

    def __len__(self) -> int:
        return len(self._boxes)

    def put(self, pcm: list[torch.Tensor], entries: list[Any]) -> None:
        """Start the host copy of one piece's PCM (one 1-D tensor per entry, same order)."""
        if not entries:
            return
        sized = [(entry, p.numel()) for entry, p in zip(entries, pcm)]
        if pcm[0].device.type != "cuda":  # already on the host: one box of the pieces as they are
            event = self.host_copy_event() if self.host_copy_event is not None else None
            self._boxes.append(_Box([p.detach().reshape(-1).float() for p in pcm], event, sized))
            return
        flat = torch.cat([p.detach().reshape(-1).float() for p in pcm])
        try:
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        except RuntimeError:  # no page-locked memory to be had: a synchronous copy still works
            self._boxes.append(_Box(flat.cpu(), None, sized))
            return
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._boxes.append(_Box(host, event, sized))

    def take(self, wait: bool = False, urgent: Callable[[Any], bool] | None = None) -> Iterator[tuple[Any, np.ndarray]]:
        """(entry, pcm) for every piece whose copy has completed, in order; ``wait``: all of them;
        ``urgent``: also every piece up to the last one holding an entry it picks (a first chunk),
        waited for. Beyond ``max_in_flight`` outstanding pieces the oldest is waited for."""
        wait_for = 0
        if urgent is not None:
            wait_for = max((i + 1 for i, box in enumerate(self._boxes) if any(urgent(e) for e, _ in box.entries)),
                           default=0)
        while self._boxes and (wait or wait_for > 0 or len(self._boxes) > self.max_in_flight
                               or self._boxes[0].ready()):
            wait_for -= 1
            box = self._boxes.popleft()
            for (entry, _), pcm in zip(box.entries, box.wait()):
                yield entry, pcm


def emit_audio(state: RequestState, pcm: np.ndarray, final: bool, text: str | None, frames_done: int) -> None:
    """Deliver one chunk of a request's audio."""
    timing = ChunkTiming(state.handle.submitted_at)
    chunk = AudioChunk(request_id=state.request_id, index=state.delivered, pcm=pcm, sample_rate=SAMPLE_RATE,
                       frames_done=frames_done, frames_total=state.frames_total, is_final=final, timing=timing,
                       text=text, truncated=state.truncated if final else None)
    state.delivered += 1
    safe_deliver(state.deliver, chunk)


def deliver_final(handle: RequestHandle, deliver: Deliver, index: int, frames_done: int, frames_total: int,
                  error: str | None, alignment: Alignment | None = None, truncated: str | None = None) -> None:
    """The empty final chunk that ends a request early (error, cancel, stop), or after its
    word alignment (``alignment``; None when it could not be aligned)."""
    chunk = AudioChunk(request_id=handle.request_id, index=index, pcm=np.zeros(0, np.float32),
                       sample_rate=SAMPLE_RATE, frames_done=frames_done, frames_total=frames_total,
                       is_final=True, error=error, timing=ChunkTiming(handle.submitted_at),
                       alignment=alignment, truncated=None if error else truncated)
    safe_deliver(deliver, chunk)
    handle.mark_done()


def safe_deliver(deliver: Deliver, chunk: AudioChunk) -> None:
    try:
        deliver(chunk)
    except Exception:  # a broken consumer must not kill the worker
        log.exception("deliver callback failed for request %s", chunk.request_id)
