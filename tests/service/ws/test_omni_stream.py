"""vllm-omni's WebSocket ``/v1/audio/speech/stream``, spoken by a plain websockets client
as vllm-omni's clients do: session.config, input.text, input.done (a flush; the socket
stays open), session.close; audio.start / binary / audio.done per sentence, session.done
per flush."""

from __future__ import annotations

import io
import json

import soundfile as sf
import websockets
from conftest import start_server

ENDPOINT = "/v1/audio/speech/stream"


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + ENDPOINT


async def flush(ws) -> list:
    """Every message up to session.done: JSON as dicts, binary frames as bytes."""
    messages = []
    while True:
        message = await ws.recv()
        messages.append(message if isinstance(message, bytes) else json.loads(message))
        if isinstance(messages[-1], dict) and messages[-1]["type"] in ("session.done", "error"):
            return messages


def sentences(messages: list) -> list[tuple[dict, bytes, dict]]:
    """(audio.start, the audio bytes, audio.done) per sentence, checking they pair up."""
    out, current, audio = [], None, bytearray()
    for message in messages:
        if isinstance(message, bytes):
            assert current is not None, "audio outside audio.start / audio.done"
            audio.extend(message)
        elif message["type"] == "audio.start":
            current, audio = message, bytearray()
        elif message["type"] == "audio.done":
            out.append((current, bytes(audio), message))
            current = None
    return out


async def test_streamed_pcm_flow_and_flushes_on_one_connection(server):
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": "default", "language": "Auto", "model": "tts-1",
                                  "response_format": "pcm", "stream_audio": True}))
        await ws.send(json.dumps({"type": "input.text", "text": "Hello there. How are"}))
        await ws.send(json.dumps({"type": "input.text", "text": " you today?"}))
        await ws.send(json.dumps({"type": "input.done"}))
        first = await flush(ws)
        assert isinstance(first[0], dict) and first[0]["type"] == "audio.start"  # no session.created: vllm-omni sends none
        parts = sentences(first)
        assert [start["sentence_text"] for start, _, _ in parts] == ["Hello there.", "How are you today?"]
        for index, (start, audio, done) in enumerate(parts):
            assert (start["utterance_index"], start["sentence_index"]) == (0, index)
            assert (start["format"], start["sample_rate"], start["channels"]) == ("pcm", 24000, 1)
            assert (done["utterance_index"], done["sentence_index"], done["error"]) == (0, index, False)
            assert done["total_bytes"] == len(audio) > 4800 and len(audio) % 2 == 0
        assert first[-1] == {"type": "session.done", "utterance_index": 0, "total_sentences": 2}

        # input.done is a flush: the same connection takes the next utterance
        await ws.send(json.dumps({"type": "input.text", "text": "Once more."}))
        await ws.send(json.dumps({"type": "input.done"}))
        second = await flush(ws)
        [(start, audio, done)] = sentences(second)
        assert (start["utterance_index"], start["sentence_index"]) == (1, 0) and len(audio) > 0
        assert second[-1] == {"type": "session.done", "utterance_index": 1, "total_sentences": 1}

        await ws.send(json.dumps({"type": "session.close"}))
        await ws.wait_closed()
        assert ws.close_code == 1000


async def test_default_config_sends_one_wav_file_per_sentence_at_the_asked_rate(server):
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": "default", "sample_rate": 16000}))
        await ws.send(json.dumps({"type": "input.text", "text": "First one. Second one."}))
        await ws.send(json.dumps({"type": "input.done"}))
        messages = await flush(ws)
    parts = sentences(messages)
    assert len(parts) == 2
    for start, audio, done in parts:
        assert start["format"] == "wav" and start["sample_rate"] == 16000
        assert sum(isinstance(m, bytes) for m in messages) == 2  # one file per sentence
        signal, rate = sf.read(io.BytesIO(audio))
        assert rate == 16000 and signal.size > 1600 and done["total_bytes"] == len(audio)


async def test_bad_config_and_cloning_fields_get_an_error_and_the_socket_keeps_working(server):
    async with websockets.connect(ws_url(server)) as ws:
        for config, expected in (({"response_format": "m4a"}, "response_format"), ({"model": "gpt-5"}, "model"),
                                 ({"ref_audio": "data:audio/wav;base64,AAAA"}, "ref_audio")):
            await ws.send(json.dumps({"type": "session.config", **config}))
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["message"].startswith(expected), error
        await ws.send(json.dumps({"type": "input.text", "text": "Still here."}))
        await ws.send(json.dumps({"type": "input.done"}))
        messages = await flush(ws)
        assert messages[-1]["type"] == "session.done" and len(sentences(messages)) == 1


async def test_api_keys_apply_in_the_socket(engine, tmp_path):
    live = await start_server(engine, tmp_path / "data", api_keys=("right-key",))
    try:
        async with websockets.connect(ws_url(live), additional_headers={"Authorization": "Bearer wrong"}) as ws:
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["code"] == "unauthorized"
        async with websockets.connect(ws_url(live), additional_headers={"Authorization": "Bearer right-key"}) as ws:
            await ws.send(json.dumps({"type": "input.text", "text": "Hi."}))
            await ws.send(json.dumps({"type": "input.done"}))
            assert (await flush(ws))[-1]["type"] == "session.done"
    finally:
        await live.stop()
