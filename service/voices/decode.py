"""Reference audio bytes -> float32 mono samples, decoding only what a voice reference may be.

Reference audio comes from clients, so FFmpeg is never left to guess: our code names the
container from its magic bytes (WAV, FLAC, Ogg, MP3, ADTS AAC, MP4/M4A, WebM/Matroska) and
anything else - SDP, HLS and DASH manifests, ffconcat lists, images, text - is refused before
FFmpeg sees a byte. The container is then opened with that demuxer forced, reading from memory
(no URL is ever opened) and with an empty protocol allow-list for anything a demuxer might try
to open on its own. The header must name an allowed codec, a sane rate, at most two channels
and a declared length within the limit; the decoding then counts samples as frames arrive and
stops at the limit, so a small file that would unpack to gigabytes (a decompression bomb)
costs no more than ``max_seconds`` of audio.

This module runs inside the decoder worker processes (service/voices/decoder_pool.py); it
imports only what decoding needs.
"""

from __future__ import annotations

import io

import av
import numpy as np
import soxr

MIN_REF_SECONDS = 1.0
SILENCE_PEAK = 1e-3  # below -60 dBFS everywhere: nothing to take a voice from
MIN_INPUT_RATE, MAX_INPUT_RATE = 8000, 192000
MAX_INPUT_CHANNELS = 2
DECLARED_SLACK = 1.1  # declared lengths of mp3/aac are estimates; the sample count is exact

NOT_ALLOWED = "not decodable as an allowed audio file (send wav, flac, ogg (opus, vorbis, flac), mp3, m4a/aac or webm)"
PCM_CODECS = frozenset({"pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le", "pcm_f64le", "pcm_u8",
                        "pcm_mulaw", "pcm_alaw"})
# container -> (FFmpeg demuxer, the codecs it may carry)
CONTAINERS: dict[str, tuple[str, frozenset[str]]] = {
    "wav": ("wav", PCM_CODECS),
    "flac": ("flac", frozenset({"flac"})),
    "ogg": ("ogg", frozenset({"opus", "vorbis", "flac"})),
    "mp3": ("mp3", frozenset({"mp3", "mp3float"})),
    "aac": ("aac", frozenset({"aac"})),
    "m4a": ("mp4", frozenset({"aac", "mp3", "mp3float"})),
    "webm": ("matroska", frozenset({"opus", "vorbis", "flac", "aac", "mp3", "mp3float"}) | PCM_CODECS),
}
# Nested opens (a playlist's segments, an mp4 data reference) are checked against this list; no
# protocol is called "none", so none is allowed.
NO_PROTOCOLS = {"protocol_whitelist": "none"}


class Refused(ValueError):
    """Reference audio that cannot be used; the message says why (shown to the client)."""


def _skip_id3(data: bytes) -> int:
    """The offset after a leading ID3v2 tag (mp3 and aac files may start with one)."""
    if len(data) >= 10 and data[:3] == b"ID3":
        size = 0
        for byte in data[6:10]:  # four 7-bit "syncsafe" bytes
            size = (size << 7) | (byte & 0x7F)
        return 10 + size + (10 if data[5] & 0x10 else 0)  # + a footer when the flag says so
    return 0


def sniff_container(data: bytes) -> str | None:
    """The container named by the file's magic bytes, or None for anything not allowed."""
    head = data[:12]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska / WebM
        return "webm"
    if head[4:8] == b"ftyp":
        return "m4a"
    start = _skip_id3(data)
    sync = data[start:start + 2]
    if len(sync) == 2 and sync[0] == 0xFF:
        if sync[1] & 0xF6 == 0xF0:  # 12 sync bits, layer 00: ADTS
            return "aac"
        if sync[1] & 0xE0 == 0xE0 and sync[1] & 0x06:  # 11 sync bits, a layer: MPEG audio
            return "mp3"
    return None


def _declared_seconds(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _mono_float(frame, resampler) -> np.ndarray:
    """One decoded frame as float32 mono (channels averaged, as the reference code does)."""
    pieces = [out.to_ndarray() for out in resampler.resample(frame)]  # planar float: (channels, samples)
    if not pieces:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate(pieces, axis=1).mean(axis=0, dtype=np.float32)


def _decode_samples(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    kind = sniff_container(data)
    if kind is None:
        raise Refused(NOT_ALLOWED)
    demuxer, codecs = CONTAINERS[kind]
    try:
        container = av.open(io.BytesIO(data), mode="r", format=demuxer, options=NO_PROTOCOLS,
                            metadata_errors="ignore")
    except (av.FFmpegError, ValueError, EOFError):
        raise Refused(f"not a readable {kind} file") from None
    with container:
        if not container.streams.audio:
            raise Refused(f"the {kind} file holds no audio stream")
        stream = container.streams.audio[0]
        codec = stream.codec_context.name
        if codec not in codecs:
            raise Refused(f"the {kind} file holds {codec} audio; allowed here: {', '.join(sorted(codecs))}")
        rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
        if not MIN_INPUT_RATE <= rate <= MAX_INPUT_RATE:
            raise Refused(f"a sample rate of {rate} Hz; between {MIN_INPUT_RATE} and {MAX_INPUT_RATE} Hz please")
        if not 1 <= channels <= MAX_INPUT_CHANNELS:
            raise Refused(f"{channels} channels; mono or stereo please")
        declared = _declared_seconds(container, stream)
        if declared is not None and declared > max_seconds * DECLARED_SLACK:
            raise Refused(f"{declared:.1f} s of audio; at most {max_seconds:g} s (--max-ref-audio-seconds)")
        resampler = av.AudioResampler(format="fltp", layout="stereo" if channels == 2 else "mono", rate=rate)
        limit = int(max_seconds * rate)
        pieces, count = [], 0
        try:
            for frame in container.decode(stream):
                if frame.sample_rate != rate or frame.layout.nb_channels != channels:
                    raise Refused("the audio changes its sample rate or channel count midway")
                count += frame.samples
                if count > limit:  # stop here: never decode more than the limit allows
                    raise Refused(f"longer than allowed: at most {max_seconds:g} s (--max-ref-audio-seconds)")
                pieces.append(_mono_float(frame, resampler))
        except av.FFmpegError:
            if not pieces:
                raise Refused(f"not decodable {kind} audio") from None
            # a damaged tail: keep what decoded, as players do
    audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    return audio, rate


def decode_reference(data: bytes, max_seconds: float, out_rate: int) -> np.ndarray:
    """Audio file bytes -> float32 mono at ``out_rate`` (resampled with soxr HQ, as the official
    package does through librosa's soxr_hq), checked for use as a voice; Refused otherwise."""
    if not data:
        raise Refused("empty")
    audio, rate = _decode_samples(data, max_seconds)
    if audio.size == 0:
        raise Refused("the audio holds no samples")
    seconds = audio.size / rate
    if seconds < MIN_REF_SECONDS:
        raise Refused(f"{seconds:.2f} s of audio; a reference voice needs at least {MIN_REF_SECONDS:g} s")
    if seconds > max_seconds:
        raise Refused(f"{seconds:.1f} s of audio; at most {max_seconds:g} s (--max-ref-audio-seconds)")
    if not np.isfinite(audio).all():
        raise Refused("the audio holds non-finite samples")
    if float(np.abs(audio).max()) < SILENCE_PEAK:
        raise Refused("the audio is silent")
    if rate != out_rate:
        audio = soxr.resample(audio, rate, out_rate, quality="HQ")
    return np.ascontiguousarray(audio, dtype=np.float32)
