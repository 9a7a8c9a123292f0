"""Contexts on a shared socket never collide: two contexts whose ids share their first 32
characters both speak in full, and a context cancelled mid-turn and reopened under the same id
at once (a voice agent's barge-in, turn after turn) is a new context every time.

Real server on the tiny DiT engine (deterministic: seed 0), clients speaking Cartesia's and
ElevenLabs' wire formats with plain ``websockets``; audio counted in samples against the same
text spoken alone."""

from __future__ import annotations

import asyncio
import json

import websockets
from dialect_helpers import (
    CARTESIA_PATH,
    ELEVENLABS_MULTI_PATH,
    cartesia_audio,
    cartesia_request,
    elevenlabs_audio,
    next_message,
    ws_base,
)

PREFIX = "voice-agent-turn-0123456789abcde"  # 32 characters
TURN = "This sentence keeps going for a while, so that it is cut off mid way. "
REPLY = "Okay."
TURN_WAIT_S = 30.0  # a turn that hangs fails the test here, not at the suite's timeout


async def cartesia_samples(server, text: str) -> int:
    """Samples of ``text`` spoken alone in one Cartesia context (pcm_s16le)."""
    async with websockets.connect(ws_base(server) + CARTESIA_PATH) as ws:
        await ws.send(cartesia_request("alone", text, False))
        samples = 0
        while (message := await next_message(ws))["type"] != "done":
            assert message["type"] != "error", message
            samples += len(cartesia_audio(message)) // 2
        return samples


async def test_cartesia_contexts_sharing_a_32_character_prefix_both_finish(server):
    texts = {PREFIX + "-a": "One sentence here.", PREFIX + "-b": "Another sentence, rather longer than that one."}
    expected = {c: await cartesia_samples(server, t) for c, t in texts.items()}
    async with websockets.connect(ws_base(server) + CARTESIA_PATH) as ws:
        for context, text in texts.items():
            await ws.send(cartesia_request(context, text, False))
        samples, done = dict.fromkeys(texts, 0), set()
        while done != set(texts):
            message = await next_message(ws, TURN_WAIT_S)
            assert message["type"] != "error", message
            samples[message["context_id"]] += len(cartesia_audio(message)) // 2
            if message["type"] == "done":
                done.add(message["context_id"])
    assert samples == expected


async def test_elevenlabs_contexts_sharing_a_32_character_prefix_both_finish(server):
    texts = {PREFIX + "-a": "One sentence here. ", PREFIX + "-b": "Another sentence, rather longer than that one. "}
    expected = {c: await cartesia_samples(server, t.strip()) for c, t in texts.items()}
    async with websockets.connect(ws_base(server) + ELEVENLABS_MULTI_PATH) as ws:
        for context, text in texts.items():
            await ws.send(json.dumps({"text": text, "context_id": context}))
            await ws.send(json.dumps({"context_id": context, "close_context": True}))
        samples, final = dict.fromkeys(texts, 0), set()
        while final != set(texts):
            message = await next_message(ws, TURN_WAIT_S)
            assert "error" not in message, message
            samples[message["contextId"]] += len(elevenlabs_audio(message)) // 2
            if message.get("isFinal"):
                final.add(message["contextId"])
    assert samples == expected


async def test_cartesia_fifty_cancel_then_reopen_turns_all_finish(server):
    """Each turn: speak, cancel 0-196 ms later, reopen the same context id at once with the
    reply; every reply finishes (``done``, no error) with at least its whole audio (audio of
    the cancelled turn already on the wire may precede it: Cartesia has no cancel ack)."""
    reply = await cartesia_samples(server, REPLY)
    async with websockets.connect(ws_base(server) + CARTESIA_PATH) as ws:
        for turn in range(50):
            await ws.send(cartesia_request("r1", TURN, True, flush=True))
            await asyncio.sleep(turn * 0.004)  # the barge-in's moment, not a synchronisation
            await ws.send(json.dumps({"context_id": "r1", "cancel": True}))
            await ws.send(cartesia_request("r1", REPLY, False))
            samples = 0
            while (message := await next_message(ws, TURN_WAIT_S))["type"] != "done":
                assert message["type"] != "error", (turn, message)
                samples += len(cartesia_audio(message)) // 2
            assert samples >= reply, turn


async def test_elevenlabs_cancel_then_reopen_turns_speak_the_whole_reply(server):
    """The same barge-in on ElevenLabs multi-stream, whose immediate close answers ``isFinal``
    at once: everything after it is the reopened context's, exactly the reply's samples."""
    reply = await cartesia_samples(server, REPLY)
    async with websockets.connect(ws_base(server) + ELEVENLABS_MULTI_PATH) as ws:
        for turn in range(20):
            await ws.send(json.dumps({"text": TURN, "context_id": "r1", "flush": True}))
            await asyncio.sleep(turn * 0.01)  # 0-190 ms
            await ws.send(json.dumps({"context_id": "r1", "close_context": True, "immediate": True}))
            await ws.send(json.dumps({"text": REPLY + " ", "context_id": "r1"}))
            await ws.send(json.dumps({"context_id": "r1", "close_context": True}))
            while not (message := await next_message(ws, TURN_WAIT_S)).get("isFinal"):  # the cancel's
                assert "error" not in message, (turn, message)
            samples = 0
            while not (message := await next_message(ws, TURN_WAIT_S)).get("isFinal"):
                assert "error" not in message, (turn, message)
                samples += len(elevenlabs_audio(message)) // 2
            assert samples == reply, turn
