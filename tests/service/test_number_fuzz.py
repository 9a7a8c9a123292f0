"""Every number a client writes outside the pydantic schema - query strings, WebSocket handshakes,
the vendors' JSON fields - read by one strict parser (service/synthesis/numbers.py): hostile text
(``"²"``, which ``str.isdigit()`` takes and ``int()`` refuses; other scripts' digits; 5,001
digits; spaces, signs, exponents) is each route's 400 in its own error shape, or a refused
handshake, never a 500; whole numbers written as floats (``"24000.0"``, JSON ``8000.0``), as the
vendors' SDKs send them, are served. The parser itself over every numeric character Unicode has.
Real server on 127.0.0.1, aiohttp and websockets clients, audio read back with soundfile."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import sys
import unicodedata
from urllib.parse import quote

import aiohttp
import numpy as np
import soundfile as sf
import websockets
from conftest import metric_value

from service.synthesis.numbers import MAX_DIGITS, decimal_number, json_whole_number, whole_number

# The texts that once made (or could make) a 500, and their neighbours
HOSTILE_TEXT = ["\u00b2", "2\u00b2", "\u0662\u0664\u0660\u0660\u0660", "\uff12\uff14\uff10\uff10\uff10", "\u2167",
                "\U0001d7ce", "9" * 5001, "9" * 400, " 24000", "24000 ", "\n24000", "24000\n", "+24000", "-24000",
                "24_000", "2.4e4", "0x5dc0", "nan", "inf", "-inf", "24000.5", "24000.", ".5", "", "1e400",
                "24000.0.0", "\x00", "\ud800"]
# JSON values in place of a vendor's number (a string, a boolean, a fraction, a 5,001-digit literal)
HOSTILE_JSON = ["8000", True, 8000.5, [8000], {"n": 8000}, None, -8000, 10**50, "\u00b2"]
HOSTILE_JSON_LITERALS = ["9" * 5001, "-" + "9" * 5001, "1e400", "8000.001", "-0"]

TEXT = "Hello there."


# -- the parser -------------------------------------------------------------------------------
def test_only_ascii_digits_are_digits_across_all_of_unicode():
    """Every character Unicode calls numeric (str.isdigit / isnumeric) is refused unless it is
    0-9, alone and inside a number (int() would take the decimal ones: "\u0661" is 1)."""
    numeric = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isnumeric() or chr(c).isdigit()]
    assert len(numeric) > 1500
    for char in numeric:
        texts = (char, "1" + char, char + "000", "8000." + char)
        if "0" <= char <= "9":
            assert [whole_number(t) for t in texts] == [int(char), int("1" + char), int(char + "000"),
                                                        8000 if char == "0" else None], char
            assert decimal_number("8000." + char) == float("8000." + char)
            continue
        for text in texts:
            assert whole_number(text) is None and decimal_number(text) is None, (unicodedata.name(char, ""), text)


def test_bounded_length_signs_spaces_and_floats_text():
    assert whole_number("9" * MAX_DIGITS) == int("9" * MAX_DIGITS)
    assert whole_number("9" * (MAX_DIGITS + 1)) is None and whole_number("9" * 5001) is None
    assert whole_number("24000.0") == 24000 and whole_number("24000.000") == 24000  # floats' text (Deepgram's SDK)
    for text in HOSTILE_TEXT:
        assert whole_number(text) is None, repr(text[:20])
    assert decimal_number("0.75") == 0.75 and decimal_number("1") == 1.0
    for text in ("nan", "inf", "1e3", "-1", " 1", "1.", ".5", "1.2.3", "\u0661", "9" * 5001):
        assert decimal_number(text) is None, text


def test_json_numbers():
    assert json_whole_number(8000) == 8000 and json_whole_number(8000.0) == 8000
    assert type(json_whole_number(8000.0)) is int  # an encoder takes ints only
    for value in ("8000", True, False, None, 8000.5, float("nan"), float("inf"), [1], {"a": 1}):
        assert json_whole_number(value) is None, value


# -- served -----------------------------------------------------------------------------------
async def refused_http(http, response, shape: set[str]) -> None:
    assert response.status != 200, (response.url, await response.read())
    body = await response.json(content_type=None)
    assert 400 <= response.status < 500 and set(body) == shape, (response.status, body)


DEEPGRAM_QUERY = {  # parameter -> the query it is tried in (the others valid)
    "sample_rate": "encoding=linear16&container=none&sample_rate={}",
    "bit_rate": "encoding=mp3&bit_rate={}",
    "speed": "encoding=linear16&speed={}",
}
DEEPGRAM_SHAPE = {"err_code", "err_msg", "request_id"}
CARTESIA_SHAPE = {"error", "title", "message", "error_code", "status_code", "request_id"}
ELEVENLABS_SHAPE = {"detail"}
OWN_SHAPE = {"error"}


async def test_every_numeric_query_parameter_refuses_hostile_text(server):
    """Deepgram's POST /v1/speak (sample_rate, bit_rate, speed), ElevenLabs' output_format on each
    HTTP route, and the list pages' limit: a 4xx in the route's shape for every hostile text."""
    async with aiohttp.ClientSession() as http:
        for text in HOSTILE_TEXT:
            if text == "\ud800":
                continue  # not encodable in a URL (the handshake test sends it raw)
            value = quote(text, safe="")
            for name, query in DEEPGRAM_QUERY.items():
                async with http.post(f"{server.url}/v1/speak?" + query.format(value), json={"text": TEXT}) as r:
                    await refused_http(http, r, DEEPGRAM_SHAPE)
            for route in ("", "/stream", "/with-timestamps", "/stream/with-timestamps"):
                async with http.post(f"{server.url}/v1/text-to-speech/default{route}?output_format=pcm_{value}",
                                     json={"text": TEXT}) as r:
                    await refused_http(http, r, ELEVENLABS_SHAPE)
            for path in ("/v1/jobs", "/v1/audio/voices"):
                async with http.get(f"{server.url}{path}?limit={value}") as r:
                    await refused_http(http, r, OWN_SHAPE)
        assert await metric_value(server.url, "streamvox_requests_total",
                                  '{endpoint="/v1/speak",outcome="internal_error"}') == 0


async def test_vendor_json_numbers_refuse_hostile_values(server):
    """Cartesia's output_format.sample_rate / bit_rate on /tts/bytes and /tts/sse, as values and as
    raw JSON literals (5,001 digits): 400 in Cartesia's shape."""
    raw_format = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}
    mp3_format = {"container": "mp3", "sample_rate": 44100, "bit_rate": 128000}
    async with aiohttp.ClientSession() as http:
        for path in ("/tts/bytes", "/tts/sse"):
            for fmt, field in ((raw_format, "sample_rate"), (mp3_format, "sample_rate"), (mp3_format, "bit_rate")):
                if path == "/tts/sse" and fmt is mp3_format:
                    continue  # (SSE sends raw audio only: refused for that first)
                for value in HOSTILE_JSON:
                    body = {"transcript": TEXT, "voice": "default", "output_format": {**fmt, field: value}}
                    async with http.post(server.url + path, json=body) as r:
                        await refused_http(http, r, CARTESIA_SHAPE)
                for literal in HOSTILE_JSON_LITERALS:
                    fields = ", ".join(f'"{k}": {literal if k == field else repr(v).replace(chr(39), chr(34))}'
                                       for k, v in fmt.items())
                    raw = ('{"transcript": "Hi.", "voice": "default", "output_format": {' + fields + "}}").encode()
                    async with http.post(server.url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                        await refused_http(http, r, CARTESIA_SHAPE)


async def raw_handshake(server, target: bytes) -> tuple[int, bytes, bytes]:
    """A WebSocket upgrade for ``target`` (the bytes as given) -> (status, head, body)."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + base64.b64encode(os.urandom(16)) + b"\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await asyncio.wait_for(reader.readexactly(length), 30)
        return int(head.split(b" ")[1]), head, body
    finally:
        writer.close()


async def test_handshakes_refuse_hostile_numbers_before_the_upgrade(server):
    """Deepgram's socket (sample_rate, speed) and ElevenLabs' (inactivity_timeout, output_format):
    an HTTP 400 in the vendor's shape, never a 500, never an upgrade; percent-encoded as clients
    send them, and raw (UTF-8 in the request line, as a careless client writes it)."""
    cases = [("/v1/speak?sample_rate={}", DEEPGRAM_SHAPE), ("/v1/speak?speed={}", DEEPGRAM_SHAPE),
             ("/v1/text-to-speech/default/stream-input?inactivity_timeout={}", ELEVENLABS_SHAPE),
             ("/v1/text-to-speech/default/multi-stream-input?output_format=pcm_{}", ELEVENLABS_SHAPE)]
    for text in HOSTILE_TEXT:
        encoded = quote(text, safe="", errors="surrogatepass").encode()
        raw = text.encode("utf-8", "surrogatepass")
        for value in (encoded, raw if not any(c in raw for c in b" \r\n\x00") else encoded):
            for path, shape in cases:
                target = path.encode().replace(b"{}", value)
                status, head, body = await raw_handshake(server, target)
                assert 400 <= status < 500, (target[:80], head[:200])
                if b"application/json" in head:  # (aiohttp's parser answers a malformed request line in plain text)
                    assert set(json.loads(body)) == shape, (target[:80], body[:200])
    assert await metric_value(server.url, "streamvox_requests_total",
                              '{endpoint="/v1/speak",outcome="internal_error"}') == 0


async def test_whole_numbers_written_as_floats_are_served(server):
    """Deepgram's SDK writes numbers as floats' text (sample_rate=16000.0), a JSON client may write
    8000.0: the audio comes at that rate, the samples of the same text at 24 kHz resampled."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/v1/speak?encoding=linear16&sample_rate=24000&container=wav",
                             json={"text": TEXT}) as r:
            assert r.status == 200
            reference, _ = sf.read(io.BytesIO(await r.read()), dtype="float32")
        async with http.post(f"{server.url}/v1/speak?encoding=linear16&sample_rate=16000.0&container=wav&speed=1.0",
                             json={"text": TEXT}) as r:
            assert r.status == 200, await r.text()
            audio, rate = sf.read(io.BytesIO(await r.read()), dtype="float32")
            assert rate == 16000 and abs(audio.size - reference.size * 2 / 3) <= 2
        body = {"transcript": TEXT, "voice": "default", "output_format": {"container": "mp3", "sample_rate": 8000.0,
                                                                          "bit_rate": 32000.0}}
        async with http.post(f"{server.url}/tts/bytes", json=body) as r:
            assert r.status == 200, await r.text()
            audio, rate = sf.read(io.BytesIO(await r.read()), dtype="float32")
            # (MP3 at 8 kHz pads more than at 44.1: its frames and the encoder's delay are 6 times longer)
            assert rate == 8000 and abs(audio.size / 8000 - reference.size / 24000) < 0.3
            assert np.abs(audio).max() > 0.01
    url = server.url.replace("http", "ws", 1) + "/v1/speak?encoding=linear16&sample_rate=16000.0"
    async with websockets.connect(url) as ws:
        assert "Metadata" in await ws.recv()
