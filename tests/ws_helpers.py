"""A client's read of one streamvox ``/v1/stream`` or vllm-omni socket round: binary audio frames
and JSON events until ``session.done``; an ``error`` event fails the test. Also: a socket's audio
up to its next JSON message (``read_until_json``)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass


@dataclass
class SessionRead:
    frames: list[bytes]  # binary messages, in order
    events: list[dict]  # JSON messages, in order, session.done last

    @property
    def audio(self) -> bytes:
        return b"".join(self.frames)

    def last(self, kind: str) -> dict | None:
        """The last event of type ``kind`` (None when there was none)."""
        return next((e for e in reversed(self.events) if e["type"] == kind), None)


async def read_until_session_done(ws, timeout_s: float | None = None) -> SessionRead:
    """``timeout_s``: the longest wait for any one message (None: no limit)."""
    read = SessionRead([], [])
    while True:
        message = await asyncio.wait_for(ws.recv(), timeout_s)
        if isinstance(message, bytes):
            read.frames.append(message)
            continue
        event = json.loads(message)
        assert event["type"] != "error", event
        read.events.append(event)
        if event["type"] == "session.done":
            return read


async def read_until_json(ws, timeout_s: float = 60.0) -> tuple[bytes, dict]:
    """The binary audio a socket sends up to its next JSON message (a Deepgram ``Flushed``, say),
    and that message."""
    audio = bytearray()
    while True:
        message = await asyncio.wait_for(ws.recv(), timeout_s)
        if isinstance(message, bytes):
            audio += message
            continue
        return bytes(audio), json.loads(message)
