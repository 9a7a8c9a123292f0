"""Whole-file audio, encoded as it arrives into a temporary file that stays in memory up to
a threshold and spills to disk beyond it (:class:`tempfile.SpooledTemporaryFile`).

A whole-file response or a job used to gather every float32 chunk, join them and encode
the lot: three copies of a signal that the work limit allows to be minutes long. Here each
chunk goes through the response encoder at once (:class:`service.synthesis.audio.StreamEncoder`; FLAC,
which that encoder holds whole, is written incrementally by libsndfile here), so what is held
is the encoded file, and only up to ``memory_bytes`` of it in memory.
"""

from __future__ import annotations

import tempfile

import numpy as np
import soundfile as sf
import soxr

from engines.contract import SAMPLE_RATE
from service.synthesis.audio import StreamEncoder, output_rate, wav_sizes

READ_BLOCK = 256 * 1024


class AudioSpool:
    """``write`` chunks, ``finish``, then ``read`` the file back in blocks; ``close`` frees it.
    Blocking (file and encoder work): call from a thread, never on the event loop."""

    def __init__(self, fmt: str, memory_bytes: int, sample_rate: int | None = None):
        self.fmt = fmt
        self.file = tempfile.SpooledTemporaryFile(max_size=memory_bytes)
        self.samples = 0
        self.size = 0
        self._encoder: StreamEncoder | None = None
        self._flac: sf.SoundFile | None = None
        self._resampler = None
        if fmt == "flac":
            rate = output_rate(fmt, sample_rate)
            self._flac = sf.SoundFile(self.file, "w", rate, 1, "PCM_16", format="FLAC")
            if rate != SAMPLE_RATE:
                self._resampler = soxr.ResampleStream(SAMPLE_RATE, rate, 1, dtype="float32")
        else:
            self._encoder = StreamEncoder(fmt, sample_rate)
            self.file.write(self._encoder.header())

    @property
    def spilled(self) -> bool:
        """The file went to disk (it outgrew ``memory_bytes``)."""
        return bool(getattr(self.file, "_rolled", False))

    def write(self, pcm: np.ndarray) -> None:
        pcm = np.asarray(pcm, dtype=np.float32)
        self.samples += pcm.size
        if self._encoder is not None:
            self.file.write(self._encoder.encode(pcm))
        else:
            self._write_flac(pcm)

    def _write_flac(self, pcm: np.ndarray, last: bool = False) -> None:
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm, last=last)
        if pcm.size:
            self._flac.write(pcm)

    def finish(self) -> int:
        """Complete the file (headers, encoder tails); returns its size in bytes."""
        if self._encoder is not None:
            self.file.write(self._encoder.finish())
        else:
            self._write_flac(np.zeros(0, dtype=np.float32), last=True)
            if self.samples == 0:  # libsndfile refuses an empty FLAC
                self._flac.write(np.zeros(SAMPLE_RATE // 100, dtype=np.float32))
            self._flac.close()  # a file object given to libsndfile stays open
        self.file.seek(0, 2)
        self.size = self.file.tell()
        if self.fmt == "wav":  # a whole file knows its length: real RIFF/data sizes
            self.file.seek(0)
            header = self.file.read(44)
            self.file.seek(0)
            self.file.write(wav_sizes(header, self.size))
        self.file.seek(0)
        return self.size

    def read(self, size: int = READ_BLOCK) -> bytes:
        return self.file.read(size)

    def close(self) -> None:
        if self._flac is not None and not self._flac.closed:
            self._flac.close()
        self.file.close()
