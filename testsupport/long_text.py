"""Long texts for tests and what reached the engine while one was spoken (each utterance's
request and raw audio, in order): tests of long text planned as utterances and of long jobs."""

from __future__ import annotations

import numpy as np

from engines.contract import SynthesisRequest

WORDS = "the quick brown fox jumps over the lazy dog".split()


def long_text(chars: int, terminators: bool = True) -> str:
    """About ``chars`` characters of sentences of 6 to 10 words (without sentence ends: one sentence)."""
    sentences, length, i = [], 0, 0
    while length < chars:
        words = [WORDS[(i + k) % len(WORDS)] for k in range(6 + i % 5)]
        sentences.append(" ".join(words).capitalize() + (", and so on." if terminators else " and so on"))
        length += len(sentences[-1]) + 1
        i += 1
    return " ".join(sentences)[:chars].rstrip()


class Recorded:
    """What reached the engine: each request's text and the raw audio it delivered, in order."""

    def __init__(self, engine):
        self.engine, self.real = engine, engine.submit
        self.requests: list[SynthesisRequest] = []
        self.audio: dict[str, list[np.ndarray]] = {}

    def __enter__(self):
        def submit(request, deliver):
            self.requests.append(request)
            pieces = self.audio.setdefault(request.id, [])

            def recording(chunk):
                pieces.append(chunk.pcm.copy())
                deliver(chunk)
            return self.real(request, recording)

        self.engine.submit = submit
        return self

    def __exit__(self, *exc):
        self.engine.submit = self.real

    def raw(self, request: SynthesisRequest) -> np.ndarray:
        return np.concatenate(self.audio[request.id] or [np.zeros(0, np.float32)])
