"""The voice-agent dialects' HTTP speech (ElevenLabs ``POST /v1/text-to-speech/{voice}``,
Cartesia ``POST /tts/bytes`` and ``/tts/sse``, Deepgram ``POST /v1/speak``) with a plain aiohttp
client, on the tiny engine: the audio in every container, encoding and rate asked for, MP3 at
the bit rate named, and each vendor's own error body and status for unknown routes, wrong
methods, bad fields and refused keys under its prefix. (The SDKs themselves:
test_dialects_http_sdks.py.)"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import aiohttp
import numpy as np
import pytest
import soundfile as sf
import websockets
from conftest import metric_value, start_server, wait_until

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


LEAVING_TEXT = " ".join(f"Sentence number {i} is spoken only if the client is still there." for i in range(40))
LEAVING_ROUTES = [  # (path, body): the routes that answer at the end, and ones that stream, for contrast
    ("/v1/text-to-speech/default/with-timestamps?output_format=pcm_24000", {"text": LEAVING_TEXT}),
    ("/v1/text-to-speech/default/stream/with-timestamps?output_format=pcm_24000", {"text": LEAVING_TEXT}),
    ("/v1/text-to-speech/default?output_format=pcm_24000", {"text": LEAVING_TEXT}),
    ("/v1/speak?encoding=linear16", {"text": LEAVING_TEXT}),
]


@pytest.mark.parametrize("path,body", LEAVING_ROUTES, ids=[p.split("?")[0] for p, _ in LEAVING_ROUTES])
async def test_a_client_that_leaves_stops_its_synthesis_on_every_route(server, path, body):
    """A client that goes away after its first sentence was synthesized: the rest of its 40
    sentences are never synthesized, also on ElevenLabs' /with-timestamps, which writes nothing
    until its one JSON answer is complete (it used to speak all 40 to nobody); the route counts
    the request client_closed. Sentences are counted as the engine requests that produced audio
    (time to first audio observations), so a slow machine cannot make this pass or fail."""
    async def sentences_spoken() -> float:
        return await metric_value(server.url, "streamvox_time_to_first_audio_seconds_count")

    before = await sentences_spoken()
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()

    async def started() -> bool:
        return await sentences_spoken() > before

    await wait_until(started, timeout_s=120)
    writer.close()  # the client leaves without reading a byte
    label = path.split("?")[0].replace("/default", "/{voice_id}")  # (the metrics' label: the route's pattern)

    async def ended() -> bool:  # the handler is done (and the engine idle): its outcome was counted
        return (await metric_value(server.url, "streamvox_requests_total",
                                   f'{{endpoint="{label}",outcome="client_closed"}}') == 1
                and server.state.engine.stats().active_requests == 0)

    await wait_until(ended, timeout_s=300)
    spoken = await sentences_spoken() - before
    assert spoken <= 10, f"{spoken:.0f} of 40 sentences were synthesized for a client that had gone"


async def test_convert_with_timestamps_holds_its_audio_once_in_a_spool(engine, tmp_path):
    """ElevenLabs' /with-timestamps answers one JSON object at the end: its audio waits in a spool
    (here 1 MiB of memory, then a temporary file) and goes out as base64 in blocks. Python's
    allocations while it is answered stay under half of its audio (they were 4-5 times the audio:
    the audio, a copy, its base64, the JSON text and its bytes), and the answer is the audio of the
    streamed route, byte for byte."""
    import tracemalloc

    text = "Hello there. " + '<break time="10s"/>' * 30  # five minutes: 28.8 MB of PCM at 48 kHz
    live = await start_server(engine, tmp_path / "data", whole_file_memory_bytes=1 << 20)
    try:
        async with aiohttp.ClientSession() as http:
            base = f"{live.url}/v1/text-to-speech/default"
            async with http.post(f"{base}/stream/with-timestamps?output_format=pcm_48000", json={"text": text}) as r:
                assert r.status == 200
                streamed = b"".join([base64.b64decode(json.loads(line)["audio_base64"])
                                     for line in (await r.read()).splitlines()])
            tracemalloc.start()
            try:
                async with http.post(f"{base}/with-timestamps?output_format=pcm_48000", json={"text": text}) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
                    with open(tmp_path / "answer.json", "wb") as out:  # (not in this process's memory)
                        async for chunk in r.content.iter_chunked(1 << 16):
                            out.write(chunk)
                    _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
        answer = json.loads((tmp_path / "answer.json").read_bytes())
        audio = base64.b64decode(answer["audio_base64"])
        assert set(answer) == {"audio_base64", "alignment", "normalized_alignment"} and answer["alignment"] is None
        assert len(audio) > 28_000_000 and audio == streamed
        assert peak < len(audio) / 2, f"{peak / 1e6:.0f} MB allocated at the peak for {len(audio) / 1e6:.0f} MB of audio"
    finally:
        await live.stop()
