"""Every (response_format, sample_rate) pair the schema accepts encodes: mp3, opus and aac
encoders take only some rates, and any other asked rate is served at the nearest one they take
(the rate the file then declares), never a 500 or a stream cut short.

Exhaustively in process: for every format and every rate from 8,000 to 48,000 Hz, the chosen
rate is one the installed FFmpeg encoder lists. Against a real server (whole files, streamed
bodies and the vllm-omni socket): each format at the rates that decide the choice (the ends of
the range, each encoder rate and its neighbours), the audio read back at the declared rate.
"""

from __future__ import annotations

import io
import json

import aiohttp
import av
import numpy as np
import pytest
import websockets
from ws_helpers import read_until_session_done

from service.synthesis.audio import STREAMABLE, output_rate
from service.synthesis.schema import SPEECH_FORMATS

LOW, HIGH = 8000, 48000
ENCODERS = {"mp3": "libmp3lame", "opus": "libopus", "aac": "aac"}  # encoders with a fixed list of rates


def encoder_rates(fmt: str) -> tuple[int, ...] | None:
    """What the installed FFmpeg says the format's encoder takes (None: any rate)."""
    return tuple(av.codec.Codec(ENCODERS[fmt], "w").audio_rates) if fmt in ENCODERS else None


def expected_rate(fmt: str, rate: int) -> int:
    """The documented choice: ulaw 8 kHz; the asked rate where the encoder takes it; else the
    nearest it takes, the higher on a tie."""
    takes = encoder_rates(fmt)
    if fmt == "ulaw":
        return 8000
    if takes is None or rate in takes:
        return rate
    return min(takes, key=lambda r: (abs(r - rate), -r))


def deciding_rates(fmt: str) -> list[int]:
    rates = {LOW, LOW + 1, 9999, 22050, HIGH - 1, HIGH}
    for rate in encoder_rates(fmt) or ():
        rates |= {rate - 1, rate, rate + 1}
    return sorted(r for r in rates if LOW <= r <= HIGH)


def test_every_rate_of_the_schema_maps_to_one_the_encoder_takes():
    for fmt in ENCODERS:
        assert encoder_rates(fmt), f"{fmt}: FFmpeg lists no rates for its encoder"
    for fmt in SPEECH_FORMATS:
        takes = encoder_rates(fmt)
        for rate in range(LOW, HIGH + 1):
            chosen = output_rate(fmt, rate)
            assert chosen == expected_rate(fmt, rate), (fmt, rate, chosen)
            assert takes is None or chosen in takes


def declared_rate(fmt: str, data: bytes, samples_hint: int | None = None) -> tuple[int, int]:
    """(rate the file declares, samples decoded) of a response body."""
    if fmt == "pcm":
        return -1, len(data) // 2
    if fmt == "ulaw":
        return -1, len(data)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        count = sum(frame.samples for frame in container.decode(stream))
        return stream.codec_context.sample_rate, count


def check_audio(fmt: str, rate: int, data: bytes) -> None:
    expected = expected_rate(fmt, rate)
    declared, count = declared_rate(fmt, data)
    assert count > 0, (fmt, rate)
    if fmt == "opus":
        assert declared == 48000  # Ogg Opus always decodes at 48 kHz, whatever rate was encoded
    elif declared != -1:
        assert declared == expected, (fmt, rate, declared, expected)


@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
async def test_each_format_encodes_at_every_deciding_rate_whole_and_streamed(server, fmt):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for rate in deciding_rates(fmt):
            for delivery in ({"stream": False}, {"stream_format": "audio"}):
                if fmt not in STREAMABLE and "stream_format" in delivery:
                    continue  # flac: whole files only
                body = {"input": "Hi.", "response_format": fmt, "sample_rate": rate, "seed": 1, **delivery}
                async with http.post(server.url + "/v1/audio/speech", json=body) as r:
                    data = await r.read()  # a stream cut short raises here
                    assert r.status == 200, (fmt, rate, delivery, data[:300])
                check_audio(fmt, rate, data)


@pytest.mark.parametrize("fmt,rate", [("mp3", 9999), ("aac", 47999), ("opus", 9999), ("mp3", 47999),
                                      ("aac", 8001), ("wav", 47999)])
async def test_the_omni_socket_sends_each_sentence_at_the_declared_rate(server, fmt, rate):
    url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": fmt, "sample_rate": rate}))
        for _ in range(2):  # the session survives the first sentence and speaks a second
            await ws.send(json.dumps({"type": "input.text", "text": "Hello there."}))
            await ws.send(json.dumps({"type": "input.done"}))
            read = await read_until_session_done(ws)
            assert all(not e["error"] for e in read.events if e["type"] == "audio.done"), read.events
            start = read.last("audio.start")
            assert start is not None and start["sample_rate"] == expected_rate(fmt, rate), start
            check_audio(fmt, rate, read.audio)


async def test_the_omni_socket_streams_pcm_at_any_rate(server):
    url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", "stream_audio": True, "sample_rate": 47999}))
        await ws.send(json.dumps({"type": "input.text", "text": "Hello there."}))
        await ws.send(json.dumps({"type": "input.done"}))
        read = await read_until_session_done(ws)
        assert read.last("audio.start")["sample_rate"] == 47999 and len(read.audio) > 0
        assert np.frombuffer(read.audio, dtype="<i2").size > 0
