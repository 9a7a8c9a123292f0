"""Runs what the scheduler picked, on the device thread (vLLM's ``execute_model()``): one
generation step of the pipeline, one bounded vocoder piece.

``trace`` (tests, profiling): when a list is given, every step appends
``("generate", rows)`` or ``("vocode", frames)`` in the order they ran.
"""

from __future__ import annotations

import logging

from engines.pipelines.base import Pipeline, Produced, StepPlan
from engines.pipelines.vocoder import VocalizeItem, Vocalizer, VocalizeResult

log = logging.getLogger("streamvox.worker")


class Executor:
    def __init__(self, pipeline: Pipeline, vocalizer: Vocalizer, trace: list | None = None):
        self.pipeline = pipeline
        self.vocalizer = vocalizer
        self.trace = trace

    def generate(self, plan: StepPlan) -> list[Produced]:
        """One step for every occupied slot (DiT: one batched forward; talker: one talker step),
        as the scheduler planned it."""
        produced = self.pipeline.tick(plan)
        if self.trace is not None:
            self.trace.append(("generate", self.pipeline.last_batch_rows))
        return produced

    def vocode(self, items: list[VocalizeItem]) -> list[VocalizeResult | Exception]:
        """PCM per item, in order; an item that fails gets its exception, the others their audio."""
        if self.trace is not None:
            self.trace.append(("vocode", sum(it.num_frames for it in items)))
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

    def release(self, request_id: str) -> None:
        """Forget a request's per-stream state (pipeline slot and decoder state)."""
        self.pipeline.drop(request_id)
        self.vocalizer.close(request_id)
