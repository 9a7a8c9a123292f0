"""Reference audio in every container the decoder allows, made here with PyAV (so tests need
no binary fixtures), and hostile inputs: manifests that name network addresses, and FLAC
decompression bombs."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import soundfile as sf

# (container name, FFmpeg muxer, encoder, file rate)
CONTAINERS = [
    ("wav", "wav", "pcm_s16le", 24000),
    ("flac", "flac", "flac", 24000),
    ("ogg-opus", "ogg", "libopus", 48000),
    ("ogg-vorbis", "ogg", "vorbis", 24000),  # libsndfile's encoder (FFmpeg's is experimental)
    ("mp3", "mp3", "libmp3lame", 24000),
    ("aac", "adts", "aac", 24000),
    ("m4a", "mp4", "aac", 24000),
    ("webm", "webm", "libopus", 48000),
]


def voice_like(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """A harmonic tone with a slow vibrato and a little noise: clearly not silent."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 15 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    signal = sum(np.sin(k * phase) / k for k in range(1, 6)) * 0.2 + 0.01 * rng.standard_normal(t.size)
    return signal.astype(np.float32)


def encode(container: str, seconds: float = 1.5, channels: int = 1) -> bytes:
    """``seconds`` of voice-like audio as one file of ``container`` (a CONTAINERS name)."""
    _, muxer, codec, rate = next(c for c in CONTAINERS if c[0] == container)
    pcm = voice_like(seconds, rate)
    layout = "stereo" if channels == 2 else "mono"
    planes = np.repeat(pcm[None, :], channels, axis=0)
    if codec == "vorbis":
        out = io.BytesIO()
        sf.write(out, planes.T, rate, format="OGG", subtype="VORBIS")
        return out.getvalue()
    out = io.BytesIO()
    with av.open(out, mode="w", format=muxer) as box:
        stream = box.add_stream(codec, rate=rate, layout=layout)
        step = 960
        for start in range(0, pcm.size, step):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(planes[:, start:start + step]), format="fltp",
                                               layout=layout)
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                box.mux(packet)
        for packet in stream.encode(None):
            box.mux(packet)
    return out.getvalue()


def all_containers() -> dict[str, bytes]:
    return {name: encode(name) for name, *_ in CONTAINERS}


# ---------------------------------------------------------------- hostile inputs


def sdp(port: int) -> bytes:
    """An SDP session: FFmpeg's sdp demuxer binds ``port`` and waits for RTP."""
    return (f"v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
            f"m=audio {port} RTP/AVP 0\r\n").encode()


def hls(url: str) -> bytes:
    return f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10.0,\n{url}\n#EXT-X-ENDLIST\n".encode()


def ffconcat(url: str) -> bytes:
    return f"ffconcat version 1.0\nfile '{url}'\n".encode()


def dash(url: str) -> bytes:
    return (f'<?xml version="1.0"?><MPD xmlns="urn:mpeg:dash:schema:mpd:2011" type="static" '
            f'mediaPresentationDuration="PT10S"><Period><AdaptationSet><Representation id="a" bandwidth="1" '
            f'mimeType="audio/mp4"><BaseURL>{url}</BaseURL></Representation></AdaptationSet></Period></MPD>').encode()


def protocol_bearing(port: int) -> dict[str, bytes]:
    """Inputs that, opened with FFmpeg's probing, reach for the network at 127.0.0.1:``port``."""
    url = f"http://127.0.0.1:{port}/a.wav"
    return {"sdp": sdp(port), "hls": hls(url), "ffconcat": ffconcat(url), "dash": dash(url),
            "rtsp-sdp": sdp(port).replace(b"RTP/AVP", b"RTP/AVP/TCP")}


def _streaminfo(rate: int, channels: int, total_samples: int, block: int = 4096) -> bytes:
    """A FLAC STREAMINFO block (the last metadata block)."""
    packed = (rate << 44) | ((channels - 1) << 41) | (15 << 36) | total_samples  # 16 bits per sample
    body = struct.pack(">HH", block, block) + b"\x00" * 6 + packed.to_bytes(8, "big") + b"\x00" * 16
    return bytes([0x80, 0, 0, len(body)]) + body


def flac_bomb(size: int = 35_000, rate: int = 48000) -> bytes:
    """``size`` bytes of FLAC whose constant frames decode to hours of audio (gigabytes as
    float): one encoded frame of a constant (65,535 samples in a dozen bytes) repeated, after a
    STREAMINFO that declares no length."""
    block = 65535
    encoded = io.BytesIO()
    with av.open(encoded, mode="w", format="flac") as box:
        stream = box.add_stream("flac", rate=rate, layout="mono")
        stream.codec_context.options = {"frame_size": str(block)}
        frame = av.AudioFrame.from_ndarray(np.full((1, block), 0.25, dtype=np.float32), format="fltp",
                                           layout="mono")
        frame.sample_rate, frame.pts = rate, 0
        packets = [bytes(p) for p in list(stream.encode(frame)) + list(stream.encode(None))]
    one = packets[0]
    header = b"fLaC" + _streaminfo(rate, 1, 0, block)
    return header + one * ((size - len(header)) // len(one))


def flac_declaring(seconds: float = 30.0, rate: int = 655350, channels: int = 8) -> bytes:
    """A tiny FLAC whose header declares ``seconds`` at ``rate`` Hz x ``channels``."""
    return b"fLaC" + _streaminfo(rate, channels, int(seconds * rate)) + b"\xff\xf8" + b"\x00" * 10_000
