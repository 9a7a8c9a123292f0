"""``speed`` for the talker pipeline: streaming time-scale modification of the PCM it delivers.

    tempo = tempo_for(engine, speed)       # None: the pipeline honours speed itself (DiT) or speed == 1
    chunk = tempo.apply(chunk)             # per AudioChunk, in order; the final chunk flushes

The Qwen3-TTS talker has no speed control of its own (the official generate has none), so the
service stretches its audio with FFmpeg's ``atempo`` filter through PyAV (WSOLA: pitch kept;
factors outside [0.5, 100] are chained, as FFmpeg documents). It streams: every chunk's audio
comes out at once, less the filter's short look-ahead, which the final chunk flushes.
"""

from __future__ import annotations

from dataclasses import replace

import av
import numpy as np

from engines.contract import SAMPLE_RATE, AudioChunk, SynthesisEngine


def atempo_factors(speed: float) -> list[float]:
    """``speed`` as a product of factors each within atempo's [0.5, 100]."""
    factors = []
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    factors.append(speed)
    return factors


class TempoStretch:
    def __init__(self, speed: float, sample_rate: int = SAMPLE_RATE):
        self.speed = speed
        self.sample_rate = sample_rate
        graph = av.filter.Graph()
        nodes = [graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono")]
        nodes += [graph.add("atempo", f"{f:.6f}") for f in atempo_factors(speed)]
        nodes.append(graph.add("abuffersink"))
        for a, b in zip(nodes, nodes[1:]):
            a.link_to(b)
        graph.configure()
        self._graph = graph
        self._pts = 0
        self._flushed = False

    def _pull(self) -> list[np.ndarray]:
        out = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                return out
            out.append(frame.to_ndarray().reshape(-1))

    def process(self, pcm: np.ndarray, final: bool = False) -> np.ndarray:
        """Stretched audio for ``pcm`` (float32 mono) as far as the filter can tell yet."""
        out: list[np.ndarray] = []
        if pcm.size and not self._flushed:
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.float32)[None], format="flt",
                                               layout="mono")
            frame.sample_rate = self.sample_rate
            frame.pts = self._pts
            self._pts += pcm.size
            self._graph.push(frame)
            out += self._pull()
        if final and not self._flushed:
            self._flushed = True
            self._graph.push(None)
            out += self._pull()
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    def apply(self, chunk: AudioChunk) -> AudioChunk:
        return replace(chunk, pcm=self.process(chunk.pcm, final=chunk.is_final))


def tempo_for(engine: SynthesisEngine, speed: float) -> TempoStretch | None:
    """A stretcher when ``speed`` is not 1 and the loaded model does not honour it (the talker;
    the DiT plans its durations with ``speed`` itself)."""
    if speed == 1.0 or engine.capabilities.honours("speed"):
        return None
    return TempoStretch(speed)


__all__ = ["TempoStretch", "atempo_factors", "tempo_for"]
