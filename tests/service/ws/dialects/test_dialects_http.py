"""The voice-agent dialects' HTTP speech (ElevenLabs ``POST /v1/text-to-speech/{voice}``,
Cartesia ``POST /tts/bytes`` and ``/tts/sse``, Deepgram ``POST /v1/speak``) with a plain aiohttp
client, on the tiny engine: the audio in every container, encoding and rate asked for, MP3 at
the bit rate named, and each vendor's own error body and status for unknown routes, wrong
methods, bad fields and refused keys under its prefix. (The SDKs themselves:
test_dialects_http_sdks.py.)"""

from __future__ import annotations

import base64
import io
import json

import aiohttp
import numpy as np
import pytest
import soundfile as sf
import websockets
from conftest import start_server

TEXT = "Hello there. How are you today? Fine, thanks. The weather is mild, and the trains run on time."
KEY = "vendor-key"


async def speech_samples(http: aiohttp.ClientSession, url: str, text: str = TEXT) -> int:
    async with http.post(f"{url}/v1/audio/speech", headers={"Authorization": f"Bearer {KEY}"},
                         json={"input": text, "response_format": "pcm"}) as response:
        assert response.status == 200
        return len(await response.read()) // 2


@pytest.fixture
async def keyed(engine, tmp_path):
    server = await start_server(engine, tmp_path / "data", api_keys=(KEY,))
    yield server
    await server.stop()


ELEVEN = {"xi-api-key": KEY}
CARTESIA = {"X-API-Key": KEY, "Cartesia-Version": "2025-04-16"}
DEEPGRAM = {"Authorization": f"Token {KEY}"}


async def test_containers_encodings_and_rates(keyed):
    """Each answer holds the samples of POST /v1/audio/speech, resampled to the rate asked for."""
    async with aiohttp.ClientSession() as http:
        reference = await speech_samples(http, keyed.url)

        async def post(path: str, body: dict, headers: dict) -> aiohttp.ClientResponse:
            response = await http.post(keyed.url + path, json=body, headers=headers)
            assert response.status == 200, await response.text()
            return response

        cases = [  # (path, body, headers, rate, how to read)
            ("/v1/speak?model=aura-2-default-en&encoding=linear16&sample_rate=16000", {"text": TEXT}, DEEPGRAM,
             16000, "wav"),
            ("/v1/speak?model=default&encoding=mulaw&container=none", {"text": TEXT}, DEEPGRAM, 8000, "ULAW"),
            ("/tts/bytes", {"transcript": TEXT, "voice": {"mode": "id", "id": "default"}, "model_id": "sonic-3",
                            "output_format": {"container": "wav", "encoding": "pcm_f32le", "sample_rate": 44100}},
             CARTESIA, 44100, "wav"),
            ("/tts/bytes", {"transcript": TEXT, "voice": "default", "model_id": "sonic-3",
                            "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 22050}},
             CARTESIA, 22050, "PCM_16"),
            ("/v1/text-to-speech/default?output_format=ulaw_8000", {"text": TEXT}, ELEVEN, 8000, "ULAW"),
            ("/v1/text-to-speech/default/stream?output_format=pcm_48000", {"text": TEXT}, ELEVEN, 48000, "PCM_16"),
        ]
        for path, body, headers, rate, kind in cases:
            response = await post(path, body, headers)
            data = await response.read()
            if kind == "wav":
                assert response.headers["Content-Type"] == "audio/wav"
                audio, sr = sf.read(io.BytesIO(data), dtype="float32")
            else:
                audio, sr = sf.read(io.BytesIO(data), format="RAW", subtype=kind, samplerate=rate, channels=1,
                                    dtype="float32")
            assert sr == rate and abs(audio.size - reference * rate / 24000) <= 2, (path, audio.size)
            assert np.abs(audio).max() > 0.01, path

        # SSE: chunk events, then done, the context id echoed
        response = await post("/tts/sse", {"transcript": TEXT, "voice": "default", "context_id": "turn-7",
                                           "output_format": {"container": "raw", "encoding": "pcm_s16le",
                                                             "sample_rate": 24000}}, CARTESIA)
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in (await response.text()).splitlines() if line.startswith("data: ")]
        assert [e["type"] for e in events][-1] == "done" and {e["context_id"] for e in events} == {"turn-7"}
        assert sum(len(base64.b64decode(e["data"])) for e in events if e["type"] == "chunk") // 2 == reference


async def test_mp3_at_the_named_bit_rate(keyed):
    """mp3_44100_<kbps> is encoded at that bit rate: the bytes are the bit rate x the duration (within 10 %)."""
    async with aiohttp.ClientSession() as http:
        seconds = await speech_samples(http, keyed.url) / 24000
        for kbps in (32, 64, 128, 192):
            async with http.post(f"{keyed.url}/v1/text-to-speech/default?output_format=mp3_44100_{kbps}",
                                 json={"text": TEXT}, headers=ELEVEN) as response:
                assert response.status == 200 and response.headers["Content-Type"] == "audio/mpeg"
                data = await response.read()
            assert abs(len(data) * 8 / seconds - kbps * 1000) <= 0.1 * kbps * 1000, (kbps, len(data) * 8 / seconds)
            audio, rate = sf.read(io.BytesIO(data), dtype="float32")
            assert rate == 44100 and abs(audio.size / rate - seconds) < 0.1


async def test_mp3_bit_rate_on_the_socket_and_the_other_vendors(keyed):
    async with aiohttp.ClientSession() as http:
        seconds = await speech_samples(http, keyed.url) / 24000
        sizes = {}
        async with http.post(f"{keyed.url}/tts/bytes", headers=CARTESIA, json={
                "transcript": TEXT, "voice": "default", "output_format": {"container": "mp3", "sample_rate": 44100,
                                                                          "bit_rate": 96000}}) as response:
            sizes[96] = len(await response.read())
        async with http.post(f"{keyed.url}/v1/speak?model=default&encoding=mp3&bit_rate=32000", headers=DEEPGRAM,
                             json={"text": TEXT}) as response:
            sizes[32] = len(await response.read())
    url = f"{keyed.url.replace('http', 'ws', 1)}/v1/text-to-speech/default/stream-input?output_format=mp3_44100_128"
    audio = bytearray()
    async with websockets.connect(url, additional_headers=ELEVEN) as ws:
        await ws.send(json.dumps({"text": " "}))
        await ws.send(json.dumps({"text": TEXT}))
        await ws.send(json.dumps({"text": ""}))
        async for message in ws:
            audio += base64.b64decode(json.loads(message).get("audio") or "")
    sizes[128] = len(audio)  # (one MP3 stream per sentence: a few frames of padding each)
    for kbps, size in sizes.items():
        assert abs(size * 8 / seconds - kbps * 1000) <= 0.1 * kbps * 1000, (kbps, size * 8 / seconds)


# (vendor, a path of its API, a good request to it, the headers with its key, the keys its error body has)
VENDORS = [
    ("elevenlabs", "/v1/text-to-speech/default", {"text": "Hi."}, ELEVEN, {"detail"}),
    ("cartesia", "/tts/bytes", {"transcript": "Hi.", "voice": "default",
                                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}},
     CARTESIA, {"error", "title", "message", "error_code", "status_code", "request_id"}),
    ("deepgram", "/v1/speak?model=default", {"text": "Hi."}, DEEPGRAM, {"err_code", "err_msg", "request_id"}),
]
PREFIXES = {"elevenlabs": "/v1/text-to-speech", "cartesia": "/tts", "deepgram": "/v1/speak"}
BAD_FIELDS = {
    "elevenlabs": [("/v1/text-to-speech/default?output_format=mp3_44100_100", {"text": "x"}),
                   ("/v1/text-to-speech/nobody", {"text": "x"}), ("/v1/text-to-speech/default", {"text": 5})],
    "cartesia": [("/tts/bytes", {"transcript": "x", "voice": "default", "output_format": {"container": "flac"}}),
                 ("/tts/bytes", {"transcript": "x", "voice": "nobody",
                                 "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 8000}}),
                 ("/tts/sse", {"transcript": "x", "voice": "default",
                               "output_format": {"container": "mp3", "sample_rate": 44100, "bit_rate": 128000}})],
    "deepgram": [("/v1/speak?model=default&encoding=flac", {"text": "x"}),
                 ("/v1/speak?model=default&encoding=mp3&bit_rate=99", {"text": "x"}),
                 ("/v1/speak?model=aura-2-nobody-en", {"text": "x"}), ("/v1/speak?model=default", {"words": "x"})],
}


@pytest.mark.parametrize("vendor,path,body,headers,shape", VENDORS, ids=[v[0] for v in VENDORS])
async def test_each_vendor_errors_in_its_own_shape(keyed, vendor, path, body, headers, shape):
    prefix = PREFIXES[vendor]
    async with aiohttp.ClientSession() as http:
        async def refused(method: str, where: str, status: int, **kwargs) -> dict:
            async with http.request(method, keyed.url + where, **kwargs) as response:
                answer = await response.json()
                assert response.status == status and set(answer) == shape, (method, where, response.status, answer)
                return answer

        async with http.post(keyed.url + path, json=body, headers=headers) as response:
            assert response.status == 200 and len(await response.read()) > 0
        await refused("POST", path, 401, json=body)  # no key
        await refused("POST", path, 401, json=body, headers={k: "wrong" if "Token" not in v else "Token wrong"
                                                             for k, v in headers.items()})
        await refused("POST", path, 401, json=body, headers={"Authorization": "Bearer wrong"})
        await refused("GET", prefix + "/no/such/route", 404, headers=headers)
        await refused("PUT", path, 405, json=body, headers=headers)
        await refused("POST", path, 400, data=b"{not json", headers={**headers, "Content-Type": "application/json"})
        for where, bad in BAD_FIELDS[vendor]:
            await refused("POST", where, 400, json=bad, headers=headers)
        text_field = "transcript" if vendor == "cartesia" else "text"
        answer = await refused("POST", path, 400, json={**body, text_field: "x" * 5000}, headers=headers)
        assert f"{text_field}: 5000 characters, the limit is 4096" in json.dumps(answer)
    async with aiohttp.ClientSession() as http:  # streamvox's own routes keep streamvox's shape
        async with http.get(keyed.url + "/v1/no/such/route", headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status == 404 and set(await response.json()) == {"error"}


async def test_a_work_limit_is_each_vendors_413_before_any_audio(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", max_work_audio_frames=10)
    try:
        async with aiohttp.ClientSession() as http:
            for vendor, path, body, headers, shape in VENDORS:
                text_field = "transcript" if vendor == "cartesia" else "text"
                async with http.post(live.url + path, json={**body, text_field: TEXT}) as response:
                    answer = await response.json()
                    assert response.status == 413 and set(answer) == shape, (vendor, answer)
                    assert "--max-work-audio-frames" in json.dumps(answer)
    finally:
        await live.stop()


async def test_a_failure_after_the_first_audio_is_an_sse_error_event(engine, tmp_path):
    """Cartesia's SSE can say it in-stream: the drain's grace ends mid-stream -> an ``error`` event."""
    from service.state import drain

    live = await start_server(engine, tmp_path / "data")
    try:
        async with aiohttp.ClientSession() as http:
            body = {"transcript": TEXT * 10, "voice": "default",
                    "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}
            async with http.post(live.url + "/tts/sse", json=body) as response:
                assert response.status == 200
                first = await response.content.readline()
                assert first.startswith(b"event: chunk")
                await drain(live.state, 0.0)
                events = [json.loads(line[6:]) for line in (await response.text()).splitlines()
                          if line.startswith("data: ")]
        assert events[-1]["type"] == "error" and events[-1]["error_code"] == "shutting_down", events[-1]
        assert events[-1]["status_code"] == 503 and "done" not in [e["type"] for e in events]
    finally:
        await live.stop()
