"""Shared helpers for engine-level tests: build a tiny engine and collect a request's audio."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from engines.build import build_engine
from engines.config import EngineConfig
from engines.contract import AudioChunk, SynthesisRequest
from engines.core.engine import Engine


@dataclass
class Collected:
    """Everything delivered for one request, in delivery order."""

    chunks: list[AudioChunk] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    first_chunk: threading.Event = field(default_factory=threading.Event)  # anything delivered
    first_audio: threading.Event = field(default_factory=threading.Event)  # a chunk with samples delivered

    def deliver(self, chunk: AudioChunk) -> None:
        self.chunks.append(chunk)
        self.first_chunk.set()
        if chunk.pcm.size:
            self.first_audio.set()
        if chunk.is_final:
            self.done.set()

    @property
    def pcm(self) -> np.ndarray:
        return np.concatenate([c.pcm for c in self.chunks]) if self.chunks else np.zeros(0, np.float32)

    @property
    def error(self) -> str | None:
        return self.chunks[-1].error if self.chunks else None


def tiny_engine(fault_hook=None, **config) -> Engine:
    """The tiny DiT on the CPU, started (no warm-up unless asked); ``config``: EngineConfig fields."""
    engine = build_engine(EngineConfig.for_tests(**{"warmup": False, **config}), fault_hook)
    engine.start()
    return engine


def run_requests(engine: Engine, requests: list[SynthesisRequest], timeout: float = 120.0) -> list[Collected]:
    """Submit all requests at once (so they share ticks) and wait for every final chunk."""
    out = [Collected() for _ in requests]
    for req, col in zip(requests, out):
        engine.submit(req, col.deliver)
    for col in out:
        assert col.done.wait(timeout), "request did not finish in time"
    return out


def run_chunks(denoiser, jobs) -> dict:
    """Admit every ChunkJob into the denoiser, tick until all finish -> {key: latents}."""
    for job in jobs:
        denoiser.admit(job)
    out = {}
    while denoiser.active_slots:
        out.update({f.key: f.latents for f in denoiser.tick()})
    return out
