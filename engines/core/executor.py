"""Runs what the scheduler picked, on the device thread (vLLM's ``execute_model()``): one
generation step of the pipeline, one bounded vocoder piece.

On a CPU of two cores or more the vocoder piece may run on a thread of its own
(``vocoder_threads``): ``submit_vocode`` hands it over and returns, the talker's next tick runs
on the worker's cores meanwhile, ``vocoded`` collects it. A frame then costs about
max(talker step, decoder) instead of their sum. At most one piece is in flight, so a stream's
pieces are decoded in the order they were picked; the decoder computes the same PCM on either
thread (its state per stream is the same). The worker touches the vocalizer itself (``release``,
and a pipeline's ``start``, which may prime a stream) only with no piece in flight.
On CUDA the piece stays on the worker thread: its graphs and copies are ordered on one device
stream already.

``trace`` (tests, profiling): when a list is given, every step appends
``("generate", rows)`` or ``("vocode", frames)`` in the order they were issued.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

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
                 vocoder_threads: int = 0):
        """``vocoder_threads``: torch threads of the vocoder's own thread (0: the piece runs on the
        caller's thread, as on CUDA)."""
        self.pipeline = pipeline
        self.vocalizer = vocalizer
        self.trace = trace
        self.vocoder_threads = vocoder_threads
        self.decode_seconds = 0.0  # the decoder's own time, on whichever thread it ran
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: tuple[Future, Any] | None = None

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
    def vocoding(self) -> bool:
        """A piece is in flight (submitted, not yet collected)."""
        return self._in_flight is not None

    def submit_vocode(self, items: list[VocalizeItem], payload: Any) -> None:
        """Start decoding ``items`` on the vocoder thread; ``payload`` comes back with the
        results. The piece in flight must have been collected first (one at a time keeps each
        stream's pieces in order)."""
        if self._in_flight is not None:
            raise RuntimeError("a vocoder piece is still in flight")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="streamvox-vocoder",
                                            initializer=own_threads, initargs=(self.vocoder_threads,))
        self._trace_vocode(items)
        self._in_flight = (self._pool.submit(self._vocode, items), payload)

    def vocoded(self, wait: bool = True) -> tuple[Any, list[VocalizeResult | Exception]] | None:
        """(payload, results) of the piece in flight once it is done (``wait``: wait for it), else
        None. An error of the thread itself (not of one item: those come back as results) is
        raised here, on the worker thread."""
        if self._in_flight is None or not (wait or self._in_flight[0].done()):
            return None
        future, payload = self._in_flight
        self._in_flight = None
        return payload, future.result()

    def shutdown(self) -> None:
        """Stop the vocoder thread (after the piece in flight, whose result is dropped)."""
        self._in_flight = None
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
        collected the piece in flight (the vocoder thread must not hold the stream meanwhile)."""
        if self._in_flight is not None:
            raise RuntimeError("release with a vocoder piece in flight")
        self.pipeline.drop(request_id)
        self.vocalizer.close(request_id)
