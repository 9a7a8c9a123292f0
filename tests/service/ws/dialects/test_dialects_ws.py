"""The ElevenLabs, Cartesia and Deepgram WebSocket dialects, spoken by plain ``websockets``
clients as those services' clients speak them, against a real server on the tiny engine.

Audio is read back with soundfile in the encoding asked for; its rate is checked by the
sample count of one text at two rates (the DiT engine is deterministic: seed 0)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf
import websockets
from conftest import start_server
from ws_helpers import read_until_json

TEXT = ["Hello there. ", "How are ", "you today?"]
RAW_SUBTYPES = {"pcm_s16le": "PCM_16", "pcm_f32le": "FLOAT", "pcm_mulaw": "ULAW"}


def ws_base(server) -> str:
    return server.url.replace("http://", "ws://")


def read_raw(data: bytes, encoding: str, rate: int) -> np.ndarray:
    audio, sr = sf.read(io.BytesIO(data), format="RAW", subtype=RAW_SUBTYPES[encoding], samplerate=rate, channels=1,
                        dtype="float32")
    assert sr == rate
    return audio


async def recv_json(ws, timeout: float = 60.0) -> dict:
    while True:
        message = await asyncio.wait_for(ws.recv(), timeout)
        if isinstance(message, str):
            return json.loads(message)


# --------------------------------------------------------------------------- ElevenLabs
async def elevenlabs_stream(server, fmt: str, pieces=TEXT, voice: str = "default") -> tuple[bytes, list[dict]]:
    url = f"{ws_base(server)}/v1/text-to-speech/{voice}/stream-input?model_id=eleven_flash_v2_5&output_format={fmt}"
    messages, audio = [], bytearray()
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"text": " ", "voice_settings": {"stability": 0.5, "similarity_boost": 0.8},
                                  "generation_config": {"chunk_length_schedule": [120, 160]}}))
        for piece in pieces:
            await ws.send(json.dumps({"text": piece}))
        await ws.send(json.dumps({"text": ""}))
        while True:
            try:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
            except websockets.ConnectionClosedOK:
                break
            messages.append(message)
            if message.get("audio"):
                audio += base64.b64decode(message["audio"])
        assert ws.close_code == 1000
    return bytes(audio), messages


async def test_elevenlabs_stream_input_pcm_rates_and_final(server):
    audio24, messages = await elevenlabs_stream(server, "pcm_24000")
    assert messages[-1] == {"isFinal": True}
    assert all(set(m) == {"audio", "isFinal", "normalizedAlignment", "alignment"} for m in messages[:-1])
    assert all(m["alignment"] is None and m["isFinal"] is False for m in messages[:-1])  # no aligner: no times
    pcm24 = read_raw(audio24, "pcm_s16le", 24000)
    assert pcm24.size > 2400 and np.abs(pcm24).max() > 0.01
    audio16, _ = await elevenlabs_stream(server, "pcm_16000")
    pcm16 = read_raw(audio16, "pcm_s16le", 16000)
    assert abs(pcm16.size - pcm24.size * 2 / 3) <= 0.01 * pcm24.size  # the same speech at two thirds the rate


async def test_elevenlabs_mp3_and_ulaw(server):
    mp3, _ = await elevenlabs_stream(server, "mp3_44100_128")
    audio, rate = sf.read(io.BytesIO(mp3), dtype="float32")
    assert rate == 44100 and audio.size > 4410
    ulaw, _ = await elevenlabs_stream(server, "ulaw_8000")
    pcm24, _ = await elevenlabs_stream(server, "pcm_24000")
    assert abs(read_raw(ulaw, "pcm_mulaw", 8000).size - len(pcm24) / 2 / 3) <= 0.01 * len(pcm24) / 2


async def test_elevenlabs_refuses_bad_handshake(server):
    base = ws_base(server)
    for path, status in ((f"/v1/text-to-speech/nobody/stream-input", 400),
                         ("/v1/text-to-speech/default/stream-input?output_format=opus_48000_64", 400),
                         ("/v1/text-to-speech/default/stream-input?inactivity_timeout=9999", 400)):
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(base + path):
                pass
        assert info.value.response.status_code == status
        assert "detail" in json.loads(info.value.response.body)


async def test_elevenlabs_hostile_input_keeps_serving(server):
    url = f"{ws_base(server)}/v1/text-to-speech/default/multi-stream-input?output_format=pcm_16000"
    async with websockets.connect(url) as ws:
        hostile = [{"text": 5, "context_id": "a"}, {"text": "hi", "context_id": 7}, {"text": "x", "flush": "yes"},
                   {"voice_settings": [1], "text": " ", "context_id": "b"}, {"context_id": "ghost", "close_context": True}]
        for message in hostile:
            await ws.send(json.dumps(message))
            error = await recv_json(ws)
            assert set(error) >= {"message", "error", "code"} and error["code"] == 1008
        await ws.send("not json")
        assert (await recv_json(ws))["error"] == "invalid_json"
        # huge text: more than the server takes at once is an error, not a crash
        await ws.send(json.dumps({"text": "a" * 100_000, "context_id": "big"}))
        assert (await recv_json(ws))["error"] in ("text_too_long", "message_too_large")
        # a flood of flushes and closes on a live context: answered, never a crash
        await ws.send(json.dumps({"text": " ", "context_id": "c"}))
        for _ in range(200):
            await ws.send(json.dumps({"context_id": "c", "flush": True}))
        await ws.send(json.dumps({"context_id": "c", "close_context": True}))
        for _ in range(20):
            await ws.send(json.dumps({"context_id": "c", "close_context": True}))
        # more than five contexts: ElevenLabs' own error
        for i in range(6):
            await ws.send(json.dumps({"text": " ", "context_id": f"n{i}"}))
        seen = []
        while "max_active_conversations" not in seen:
            message = await recv_json(ws)
            seen.append(message.get("error"))
    # another client is served meanwhile and after
    audio, messages = await elevenlabs_stream(server, "pcm_24000", ["Still here."])
    assert messages[-1] == {"isFinal": True} and len(audio) > 0


async def test_elevenlabs_auth(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", api_keys=("k1",))
    try:
        base = f"{ws_base(live)}/v1/text-to-speech/default/stream-input?output_format=pcm_24000"
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(base):
                pass
        assert info.value.response.status_code == 401
        for kwargs, url in (({"additional_headers": {"xi-api-key": "k1"}}, base), ({}, base + "&xi-api-key=k1")):
            async with websockets.connect(url, **kwargs) as ws:
                await ws.send(json.dumps({"text": " "}))
                await ws.send(json.dumps({"text": "Hi."}))
                await ws.send(json.dumps({"text": ""}))
                while not (await recv_json(ws)).get("isFinal"):
                    pass
    finally:
        await live.stop()


# --------------------------------------------------------------------------- multi-context barge-in
def cartesia_request(context_id: str, transcript: str, more: bool, **extra) -> str:
    return json.dumps({"model_id": "sonic-2", "transcript": transcript, "context_id": context_id, "continue": more,
                       "voice": {"mode": "id", "id": "default"}, "language": "en", "add_timestamps": True,
                       "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000},
                       **extra})


LONG = ("This is a rather long sentence that keeps going for a while so that it is cancelled mid way. "
        "And here is another sentence after it, which should never be heard at all. ")


async def five_contexts(ws, send_text, send_end, cancel, audio_of, is_end, victim="c2"):
    """Five contexts interleaved on one socket; ``victim`` is cancelled after its first audio.
    Returns {context: bytes} and the number of audio messages of the victim after the cancel."""
    contexts = [f"c{i}" for i in range(5)]
    for piece in ("One sentence. ", "Two sentences here. "):
        for c in contexts:
            await send_text(c, LONG if c == victim else piece)
    for c in contexts:
        await send_end(c)
    audio = {c: bytearray() for c in contexts}
    ended: set[str] = set()
    after_cancel = None
    while ended | {victim} != set(contexts) or after_cancel is None:
        message = await asyncio.wait_for(ws.recv(), 120)
        context, data = audio_of(message)
        if data:
            audio[context] += data
            if context == victim:
                if after_cancel is None:
                    await cancel(victim)
                    after_cancel = 0
                else:
                    after_cancel += 1
        if is_end(message):
            ended.add(context)
    assert victim not in ended or after_cancel is not None
    # nothing more for the victim: no audio of it within a second (what the others send meanwhile is read)
    with pytest.raises(asyncio.TimeoutError):
        while True:
            message = await asyncio.wait_for(ws.recv(), 1.0)
            if audio_of(message)[0] == victim and audio_of(message)[1]:
                after_cancel += 1
                break
    return audio, after_cancel


async def reference_audio(server, text: str) -> int:
    """Samples of ``text`` spoken alone over the Cartesia socket (pcm_s16le, 24 kHz)."""
    async with websockets.connect(f"{ws_base(server)}/tts/websocket?cartesia_version=2025-04-16") as ws:
        await ws.send(cartesia_request("ref", text, False))
        data = bytearray()
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if message["type"] == "chunk":
                data += base64.b64decode(message["data"])
            if message["type"] == "done":
                return len(data) // 2


async def test_cartesia_five_contexts_one_cancelled(server):
    async with websockets.connect(f"{ws_base(server)}/tts/websocket?cartesia_version=2025-04-16",
                                  additional_headers={"Cartesia-Version": "2025-04-16"}) as ws:
        def audio_of(message):
            m = json.loads(message)
            return m.get("context_id"), base64.b64decode(m["data"]) if m["type"] == "chunk" else b""

        audio, after = await five_contexts(
            ws, lambda c, t: ws.send(cartesia_request(c, t, True)),
            lambda c: ws.send(cartesia_request(c, "", False)),
            lambda c: ws.send(json.dumps({"context_id": c, "cancel": True})),
            audio_of, lambda m: json.loads(m)["type"] == "done")
    assert after <= 1  # the victim's audio stops within one chunk
    full = await reference_audio(server, "One sentence. Two sentences here.")
    for context, data in audio.items():
        if context != "c2":
            assert len(data) // 2 == full, context  # complete audio, the same as spoken alone
    long_full = await reference_audio(server, LONG)
    assert 0 < len(audio["c2"]) // 2 < long_full


async def test_elevenlabs_multi_five_contexts_one_closed_immediately(server):
    url = f"{ws_base(server)}/v1/text-to-speech/default/multi-stream-input?output_format=pcm_24000"
    async with websockets.connect(url) as ws:
        async def send_text(c, t):
            await ws.send(json.dumps({"text": t, "context_id": c}))

        async def send_end(c):
            await ws.send(json.dumps({"text": "", "context_id": c, "flush": True}))
            await ws.send(json.dumps({"context_id": c, "close_context": True}))

        def audio_of(message):
            m = json.loads(message)
            return m.get("contextId"), base64.b64decode(m["audio"]) if m.get("audio") else b""

        audio, after = await five_contexts(
            ws, send_text, send_end,
            lambda c: ws.send(json.dumps({"context_id": c, "close_context": True, "immediate": True})),
            audio_of, lambda m: bool(json.loads(m).get("isFinal")))
    assert after <= 1
    full = await reference_audio(server, "One sentence. Two sentences here.")
    assert all(len(d) // 2 == full for c, d in audio.items() if c != "c2")


async def test_cartesia_formats_flush_and_errors(server):
    async with websockets.connect(f"{ws_base(server)}/tts/websocket?api_key=unused") as ws:
        streams = {}
        for encoding, rate in (("pcm_s16le", 24000), ("pcm_f32le", 16000), ("pcm_mulaw", 8000)):
            fmt = {"container": "raw", "encoding": encoding, "sample_rate": rate}
            await ws.send(cartesia_request(encoding, "Hello there. ", True, output_format=fmt, flush=True))
            await ws.send(cartesia_request(encoding, "How are you today?", False, output_format=fmt))
            streams[encoding] = (rate, bytearray(), [])
        done = set()
        while len(done) < 3:
            m = json.loads(await asyncio.wait_for(ws.recv(), 60))
            rate, data, events = streams[m["context_id"]]
            events.append(m["type"])
            if m["type"] == "chunk":
                data += base64.b64decode(m["data"])
            elif m["type"] == "flush_done":
                assert m["flush_id"] == 1 and m["flush_done"] is True
            elif m["type"] == "done":
                done.add(m["context_id"])
        samples = {}
        for encoding, (rate, data, events) in streams.items():
            assert events.index("flush_done") < events.index("done") and "timestamps" not in events
            pcm = read_raw(bytes(data), encoding, rate)
            assert np.abs(pcm).max() > 0.01
            samples[encoding] = pcm.size * 24000 / rate
        assert samples["pcm_f32le"] == pytest.approx(samples["pcm_s16le"], rel=0.01)
        assert samples["pcm_mulaw"] == pytest.approx(samples["pcm_s16le"], rel=0.01)
        # hostile: each answered by Cartesia's error, the socket keeps working
        hostile = ['{"transcript": 5, "context_id": "h", "voice": {"mode": "id", "id": "default"}}',
                   cartesia_request("h", "x", True, voice={"mode": "embedding", "embedding": [0.1]}),
                   cartesia_request("h", "x", True, output_format={"container": "wav", "encoding": "pcm_s16le",
                                                                   "sample_rate": 24000}),
                   cartesia_request("h", "x", True, voice={"mode": "id", "id": "nobody"}),
                   json.dumps({"context_id": "ghost", "cancel": True}), "[1, 2]",
                   cartesia_request("h", "x", "maybe")]
        for message in hostile:
            await ws.send(message)
            error = await recv_json(ws)
            assert error["type"] == "error" and error["status_code"] == 400 and error["done"] is True, error
        await ws.send(cartesia_request("huge", "a" * 100_000, True))
        assert (await recv_json(ws))["type"] == "error"
        await ws.send(cartesia_request("after", "Still here.", False))
        types = []
        while "done" not in types:
            types.append((await recv_json(ws))["type"])
        assert "chunk" in types


# --------------------------------------------------------------------------- Deepgram
async def test_deepgram_speak_flush_clear(server):
    url = f"{ws_base(server)}/v1/speak?model=aura-2-default-en&encoding=linear16&sample_rate=16000"
    async with websockets.connect(url) as ws:
        metadata = json.loads(await ws.recv())
        assert metadata["type"] == "Metadata" and metadata["model_name"] == "aura-2-default-en"
        for piece in TEXT:
            await ws.send(json.dumps({"type": "Speak", "text": piece}))
        await ws.send(json.dumps({"type": "Flush"}))
        audio, message = await read_until_json(ws)
        assert message == {"type": "Flushed", "sequence_id": 1}
        pcm = read_raw(audio, "pcm_s16le", 16000)
        assert pcm.size > 1600
        # barge-in: Clear during a long text stops the audio within one chunk, then Cleared
        await ws.send(json.dumps({"type": "Speak", "text": LONG}))
        await ws.send(json.dumps({"type": "Flush"}))
        first = await asyncio.wait_for(ws.recv(), 60)
        assert isinstance(first, bytes)
        await ws.send(json.dumps({"type": "Clear"}))
        after = 0
        replies = []
        while len(replies) < 2:
            message = await asyncio.wait_for(ws.recv(), 60)
            if isinstance(message, bytes):
                after += 1
            else:
                replies.append(json.loads(message))
        assert replies == [{"type": "Flushed", "sequence_id": 2}, {"type": "Cleared", "sequence_id": 3}]
        assert after <= 1
        # hostile
        for message in ('{"type": "Speak", "text": 3}', '{"type": "Dance"}', "[]", b"\x00\x01"):
            await ws.send(message)
            reply = json.loads(await ws.recv())
            assert reply["type"] == "Error" and reply["err_code"] in ("INVALID_MESSAGE", "INVALID_JSON"), reply
        for _ in range(100):
            await ws.send(json.dumps({"type": "Flush"}))
        kinds = set()
        for _ in range(100):
            kinds.add(json.loads(await asyncio.wait_for(ws.recv(), 60))["type"])
        assert kinds <= {"Flushed", "Warning"}
        await ws.send(json.dumps({"type": "Close"}))
        with pytest.raises(websockets.ConnectionClosedOK):
            await asyncio.wait_for(ws.recv(), 10)


async def test_deepgram_mulaw_and_handshake_errors(server):
    url = f"{ws_base(server)}/v1/speak?model=default&encoding=mulaw"
    async with websockets.connect(url) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "Speak", "text": "Hello there."}))
        await ws.send(json.dumps({"type": "Flush"}))
        audio = bytearray()
        while isinstance(message := await asyncio.wait_for(ws.recv(), 60), bytes):
            audio += message
        assert read_raw(bytes(audio), "pcm_mulaw", 8000).size > 800
    for query in ("model=nobody", "encoding=flac", "sample_rate=3", "speed=9"):
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(f"{ws_base(server)}/v1/speak?{query}"):
                pass
        assert info.value.response.status_code == 400
        assert set(json.loads(info.value.response.body)) == {"err_code", "err_msg", "request_id"}


async def test_deepgram_token_auth(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", api_keys=("k1",))
    try:
        url = f"{ws_base(live)}/v1/speak?model=default"
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(url, additional_headers={"Authorization": "Token wrong"}):
                pass
        assert info.value.response.status_code == 401
        async with websockets.connect(url, additional_headers={"Authorization": "Token k1"}) as ws:
            assert json.loads(await ws.recv())["type"] == "Metadata"
        async with websockets.connect(url, subprotocols=["token", "k1"]) as ws:
            assert json.loads(await ws.recv())["type"] == "Metadata"
    finally:
        await live.stop()


# --------------------------------------------------------------------------- ElevenLabs HTTP
async def test_elevenlabs_http_stream_and_with_timestamps(server):
    import aiohttp

    async with aiohttp.ClientSession() as http:
        url = f"{server.url}/v1/text-to-speech/default/stream?output_format=pcm_16000"
        async with http.post(url, json={"text": "Hello there. How are you today?", "model_id": "eleven_flash_v2_5",
                                        "voice_settings": {"stability": 0.5}}) as response:
            assert response.status == 200 and response.headers["Content-Type"] == "audio/pcm"
            pcm16 = read_raw(await response.read(), "pcm_s16le", 16000)
        async with http.post(url.replace("/stream?", "/stream/with-timestamps?").replace("16000", "24000"),
                             json={"text": "Hello there. How are you today?"}) as response:
            lines = [json.loads(line) for line in (await response.read()).splitlines()]
        assert all(line["alignment"] is None for line in lines)
        pcm24 = read_raw(b"".join(base64.b64decode(line["audio_base64"]) for line in lines), "pcm_s16le", 24000)
        assert pcm24.size > 2400 and abs(pcm16.size - pcm24.size * 2 / 3) <= 0.01 * pcm24.size
        for path, body, status in (("/v1/text-to-speech/nobody/stream", {"text": "x"}, 400),
                                   ("/v1/text-to-speech/default/stream", {"text": 5}, 400),
                                   ("/v1/text-to-speech/default/stream?output_format=wav", {"text": "x"}, 400),
                                   ("/v1/text-to-speech/default/stream", {"text": "x" * 100_000}, 400)):
            async with http.post(server.url + path, json=body) as response:
                assert response.status == status and "detail" in await response.json(), path
