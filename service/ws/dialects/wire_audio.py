"""Audio as the voice-agent dialects put it on the wire: raw PCM (int16 or float32), G.711
mu-law, or MP3, at the rate the client asked for, encoded chunk by chunk as it is generated.

    encoder = WireEncoder("pcm_f32le", 44100)
    data = encoder.encode(pcm_24k)   # bytes for this chunk (the resampler may hold a few samples)
    tail = encoder.finish()           # the rest, at the end of an utterance
"""

from __future__ import annotations

import numpy as np
import soxr

from engines.contract import SAMPLE_RATE
from service.synthesis.audio import StreamEncoder, to_pcm16, ulaw_encode

ENCODINGS = ("pcm_s16le", "pcm_f32le", "pcm_mulaw", "mp3")
MIN_RATE, MAX_RATE = 8000, 48000


class WireEncoder:
    def __init__(self, encoding: str, sample_rate: int):
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r}")
        self.encoding = encoding
        self.sample_rate = sample_rate
        self._mp3 = StreamEncoder("mp3", sample_rate) if encoding == "mp3" else None
        self._resampler = (soxr.ResampleStream(SAMPLE_RATE, sample_rate, 1, dtype="float32")
                           if self._mp3 is None and sample_rate != SAMPLE_RATE else None)

    def encode(self, pcm: np.ndarray, last: bool = False) -> bytes:
        if self._mp3 is not None:
            return self._mp3.encode(pcm)
        pcm = np.asarray(pcm, dtype=np.float32)
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm, last=last)
        if self.encoding == "pcm_f32le":
            return np.clip(pcm, -1.0, 1.0).astype("<f4").tobytes()
        pcm16 = to_pcm16(pcm)
        if self.encoding == "pcm_mulaw":
            return ulaw_encode(np.frombuffer(pcm16, dtype="<i2"))
        return pcm16

    def finish(self) -> bytes:
        if self._mp3 is not None:
            return self._mp3.finish()
        if self._resampler is not None:
            return self.encode(np.zeros(0, dtype=np.float32), last=True)
        return b""
