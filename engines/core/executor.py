"""Runs what the scheduler picked, on the device thread (vLLM's ``execute_model()``): one
generation step of the pipeline, one bounded vocoder piece.

On a CPU of two cores or more the vocoder pieces may run on a thread of their own
(``vocoder_threads``): ``submit_vocode`` hands a piece over and returns, the talker's next ticks
run on the worker's cores meanwhile, ``vocoded`` collects the pieces in the order they were
handed over. A frame then costs about max(talker step, decoder) instead of their sum. The one
thread decodes the pieces first in, first out, so a stream's chunks are decoded in order and
with the same state as on the worker thread: the same PCM. The worker touches the vocalizer
itself (``release``, and a pipeline's ``start``, which may prime a stream) only with no piece
in flight.
On CUDA the piece stays on the worker thread: its graphs and copies are ordered on one device
stream already.

``trace`` (tests, profiling): when a list is given, every step appends
``("generate", rows)`` or ``("vocode", frames)`` in the order they were issued.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from engines.pipelines.base import Pipeline, Produced, StepPlan
from engines.pipelines.vocoder import VocalizeItem, Vocalizer, VocalizeResult

log = logging.getLogger("streamvox.worker")


def split_cpu_threads(total: int) -> tuple[int, int]:
    """torch intra-op threads for (the talker's worker thread, the vocoder thread) out of
    ``total``: the talker gets the larger half (its ONNX Runtime pool is half of the process's
    threads already, engines/models/quantize_nbits.py), the decoder the rest, so the two run on
    their own cores instead of taking turns on all of them."""
    vocoder = max(1, total // 2)
    return max(1, total - vocoder), vocoder


def own_threads(threads: int) -> None:
    """Give the calling thread ``threads`` torch intra-op threads. torch sets a new thread's
    count lazily from the process-wide one on its first parallel op, which would undo a bare
    ``set_num_threads``: reading the count first does that initialisation, then the thread
    keeps what is set here (OpenMP's thread count is per calling thread)."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


class Executor:
    def __init__(self, pipeline: Pipeline, vocalizer: Vocalizer, trace: list | None = None,
                 vocoder_threads: int = 0, on_vocoded: Callable[[], None] | None = None):
        """``vocoder_threads``: torch threads of the vocoder's own thread (0: the piece runs on the
        caller's thread, as on CUDA); ``on_vocoded``: called (on the vocoder thread) as each piece
        is done, to wake the caller."""
        self.pipeline = pipeline
        self.vocalizer = vocalizer
        self.trace = trace
        self.vocoder_threads = vocoder_threads
        self.decode_seconds = 0.0  # the decoder's own time, on whichever thread it ran
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: deque[tuple[Future, Any]] = deque()  # oldest first
        self._on_vocoded = on_vocoded

    def generate(self, plan: StepPlan) -> list[Produced]:
        """One step for every occupied slot (DiT: one batched forward; talker: one talker step),
        as the scheduler planned it."""
        produced = self.pipeline.tick(plan)
        if self.trace is not None:
            self.trace.append(("generate", self.pipeline.last_batch_rows))
        return produced

    def vocode(self, items: list[VocalizeItem]) -> list[VocalizeResult | Exception]:
        """PCM per item, in order, on this thread; an item that fails gets its exception, the
        others their audio."""
        self._trace_vocode(items)
        return self._vocode(items)

    # ------------------------------------------------- the vocoder's own thread
    @property
    def overlapped(self) -> bool:
        """Whether vocoder pieces run on their own thread (``submit_vocode``)."""
        return self.vocoder_threads > 0

    @property
    def vocoding(self) -> int:
        """Pieces in flight (handed over, not yet collected)."""
        return len(self._in_flight)

    def submit_vocode(self, items: list[VocalizeItem], payload: Any) -> None:
        """Queue ``items`` for the vocoder thread, after the pieces already in flight; ``payload``
        comes back with the results."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="streamvox-vocoder",
                                            initializer=own_threads, initargs=(self.vocoder_threads,))
        self._trace_vocode(items)
        future = self._pool.submit(self._vocode, items)
        if self._on_vocoded is not None:
            future.add_done_callback(lambda _: self._on_vocoded())
        self._in_flight.append((future, payload))

    def vocoded(self, wait: bool = True) -> tuple[Any, list[VocalizeResult | Exception]] | None:
        """(payload, results) of the oldest piece in flight once it is done (``wait``: wait for
        it), else None. An error of the thread itself (not of one item: those come back as
        results) is raised here, on the worker thread."""
        if not self._in_flight or not (wait or self._in_flight[0][0].done()):
            return None
        future, payload = self._in_flight.popleft()
        return payload, future.result()

    def shutdown(self) -> None:
        """Stop the vocoder thread (after the pieces in flight, whose results are dropped)."""
        self._in_flight.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ------------------------------------------------------------------ shared
    def _trace_vocode(self, items: list[VocalizeItem]) -> None:
        if self.trace is not None:
            self.trace.append(("vocode", sum(it.num_frames for it in items)))

    def _vocode(self, items: list[VocalizeItem]) -> list[VocalizeResult | Exception]:
        t0 = time.perf_counter()
        try:
            return list(self.vocalizer.vocalize(items))
        except Exception:
            # Isolate the culprit: results do not depend on batch composition, so re-running
            # item by item gives the others exactly the same audio.
            results: list[VocalizeResult | Exception] = []
            for item in items:
                try:
                    results.extend(self.vocalizer.vocalize([item]))
                except Exception as exc:
                    log.warning("request %s failed in the vocalizer: %s", item.stream_id, exc)
                    results.append(exc)
            return results
        finally:
            self.decode_seconds += time.perf_counter() - t0

    def release(self, request_id: str) -> None:
        """Forget a request's per-stream state (pipeline slot and decoder state). The caller has
        collected the pieces in flight (the vocoder thread must not hold the stream meanwhile)."""
        if self._in_flight:
            raise RuntimeError("release with a vocoder piece in flight")
        self.pipeline.drop(request_id)
        self.vocalizer.close(request_id)
