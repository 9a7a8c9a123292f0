"""Whole-file audio, encoded as it arrives into a temporary file that stays in memory up to
a threshold and spills to disk beyond it (:class:`tempfile.SpooledTemporaryFile`).

A whole-file response or a job used to gather every float32 chunk, join them and encode
the lot: three copies of a signal that the work limit allows to be minutes long. Here each
chunk is encoded at once (libsndfile writes FLAC / MP3 / Opus / WAV incrementally; raw PCM
and mu-law are plain bytes), so what is held is the encoded file, and only up to
``memory_bytes`` of it in memory.
"""

from __future__ import annotations

import tempfile

import numpy as np
import soundfile as sf
import soxr

from engines.contract import SAMPLE_RATE

from .audio import _SNDFILE, ULAW_RATE, _ulaw_of, to_pcm16

READ_BLOCK = 256 * 1024


class AudioSpool:
    """``write`` chunks, ``finish``, then ``read`` the file back in blocks; ``close`` frees it.
    Blocking (file and encoder work): call from a thread, never on the event loop."""

    def __init__(self, fmt: str, memory_bytes: int):
        self.fmt = fmt
        self.file = tempfile.SpooledTemporaryFile(max_size=memory_bytes)
        self.samples = 0
        self.size = 0
        self._resampler = soxr.ResampleStream(SAMPLE_RATE, ULAW_RATE, 1, dtype="float32") if fmt == "ulaw" else None
        self._sound: sf.SoundFile | None = None
        if fmt == "wav":
            self._sound = sf.SoundFile(self.file, "w", SAMPLE_RATE, 1, "PCM_16", format="WAV")
        elif fmt in _SNDFILE:
            container, subtype = _SNDFILE[fmt]
            self._sound = sf.SoundFile(self.file, "w", SAMPLE_RATE, 1, subtype, format=container)

    @property
    def spilled(self) -> bool:
        """The file went to disk (it outgrew ``memory_bytes``)."""
        return bool(getattr(self.file, "_rolled", False))

    def write(self, pcm: np.ndarray) -> None:
        pcm = np.asarray(pcm, dtype=np.float32)
        self.samples += pcm.size
        if self._sound is not None:
            if pcm.size:
                self._sound.write(pcm)
        elif self._resampler is not None:
            self.file.write(_ulaw_of(self._resampler.resample_chunk(pcm)))
        else:
            self.file.write(to_pcm16(pcm))

    def finish(self) -> int:
        """Complete the file (headers, encoder tails); returns its size in bytes."""
        if self._sound is not None:
            if self.samples == 0 and self.fmt in _SNDFILE:  # some encoders refuse an empty signal
                self._sound.write(np.zeros(SAMPLE_RATE // 100, dtype=np.float32))
            self._sound.close()  # a file object given to libsndfile stays open
        elif self._resampler is not None:
            self.file.write(_ulaw_of(self._resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)))
        self.file.seek(0, 2)
        self.size = self.file.tell()
        self.file.seek(0)
        return self.size

    def read(self, size: int = READ_BLOCK) -> bytes:
        return self.file.read(size)

    def close(self) -> None:
        if self._sound is not None and not self._sound.closed:
            self._sound.close()
        self.file.close()
