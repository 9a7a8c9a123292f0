"""Where a command writes its audio (``--out``) and in which format: both checked before any
work, so a typo costs one line on stderr, not a traceback after the audio was made.

The format comes from the file's extension (``.wav``, ``.flac``, ``.mp3``, ``.ogg``/``.opus``
(Ogg Opus), ``.aac`` (ADTS), ``.pcm`` (raw 16-bit little-endian mono)); the bytes are the
server's own encoders' (service/synthesis/audio.py), so a file equals what ``POST
/v1/audio/speech`` answers in that format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# extension -> the server's response_format name
FORMATS = {".wav": "wav", ".flac": "flac", ".mp3": "mp3", ".ogg": "opus", ".opus": "opus", ".aac": "aac",
           ".pcm": "pcm"}
EXTENSIONS = ", ".join(FORMATS)


class OutputError(Exception):
    """The file cannot be written there, or not in that format; the message is one line for stderr."""


@dataclass(frozen=True)
class AudioFile:
    path: Path
    format: str  # a response_format of the server's: wav, flac, mp3, opus, aac, pcm


def audio_file(path: str, flag: str = "--out", fmt: str | None = None) -> AudioFile:
    """``path`` checked: its format known (``fmt``, else from its extension) and encodable here, its
    folder made when missing, the file creatable. OutputError saying why not."""
    from service.synthesis.audio import format_available

    target = Path(path)
    named = FORMATS.get(target.suffix.lower())
    if fmt is not None and named is not None and named != fmt:
        raise OutputError(f"{flag} {path}: a {target.suffix} name, but the format asked is {fmt}")
    fmt = fmt or named
    if fmt is None:
        what = f"{target.suffix} is not an audio format" if target.suffix else "no extension to tell the format"
        raise OutputError(f"{flag} {path}: {what}; end the name in one of {EXTENSIONS}")
    if not format_available(fmt):
        raise OutputError(f"{flag} {path}: this installation has no {fmt} encoder; use .wav or .flac")
    if target.is_dir():
        raise OutputError(f"{flag} {path}: is a folder; name a file in it")
    folder = target.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{flag} {path}: cannot create the folder {folder}: {exc.strerror or exc}") from None
    existed = target.exists()
    try:  # the one sure test (os.access says yes to root everywhere, /proc included); nothing truncated
        with open(target, "ab"):
            pass
    except OSError as exc:
        raise OutputError(f"{flag} {path}: cannot write the file: {exc.strerror or exc}") from None
    if not existed:
        target.unlink(missing_ok=True)
    return AudioFile(target, fmt)


def write_audio(target: AudioFile, samples: np.ndarray, flag: str = "--out") -> None:
    """24 kHz mono audio (float32 in [-1, 1], or int16 as a stream carries it) into ``target``."""
    from service.synthesis.audio import encode_file

    if samples.dtype == np.int16:  # the inverse of the server's float -> int16 (x 32767): exact round trip
        samples = samples.astype(np.float32) / 32767.0
    _write(target, encode_file(samples, target.format), flag)


def write_audio_bytes(target: AudioFile, data: bytes, flag: str = "--out") -> None:
    """A whole WAV or FLAC file (a job's audio) into ``target``: as it is when the formats agree,
    else decoded and encoded in ``target``'s format."""
    import io

    import soundfile as sf

    with sf.SoundFile(io.BytesIO(data)) as source:
        if FORMATS.get("." + source.format.lower()) == target.format:
            _write(target, data, flag)
            return
        samples = source.read(dtype="int16")
    write_audio(target, samples, flag)


def _write(target: AudioFile, data: bytes, flag: str) -> None:
    try:
        target.path.write_bytes(data)
    except OSError as exc:
        raise OutputError(f"{flag} {target.path}: {exc.strerror or exc}") from None
