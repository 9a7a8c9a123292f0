"""Clients of the voice-agent dialects' sockets (Cartesia, ElevenLabs multi-stream), as those
services' clients speak them: the messages they send and a read of one context's audio."""

from __future__ import annotations

import asyncio
import base64
import json

CARTESIA_PATH = "/tts/websocket?cartesia_version=2025-04-16"
ELEVENLABS_MULTI_PATH = "/v1/text-to-speech/default/multi-stream-input?output_format=pcm_24000"


def ws_base(server) -> str:
    return server.url.replace("http://", "ws://")


def cartesia_request(context_id: str, transcript: str, more: bool, **extra) -> str:
    return json.dumps({"model_id": "sonic-2", "transcript": transcript, "context_id": context_id, "continue": more,
                       "voice": {"mode": "id", "id": "default"}, "language": "en", "add_timestamps": True,
                       "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000},
                       **extra})


def cartesia_audio(message: dict) -> bytes:
    return base64.b64decode(message["data"]) if message.get("type") == "chunk" else b""


def elevenlabs_audio(message: dict) -> bytes:
    return base64.b64decode(message["audio"]) if message.get("audio") else b""


async def next_message(ws, timeout_s: float = 60.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
