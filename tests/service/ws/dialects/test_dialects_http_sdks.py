"""The voice-agent SDKs' plain HTTP calls, unmodified, against a live streamvox: the cartesia
SDK's ``tts.generate`` (POST /tts/bytes) and ``tts.generate_sse`` (POST /tts/sse), the
elevenlabs SDK's ``text_to_speech.convert`` and ``convert_with_timestamps``, the deepgram SDK's
``speak.v1.audio.generate`` (POST /v1/speak) and Pipecat's ``DeepgramHttpTTSService``; and the
clients that name a vendor's stock voice by default (Pipecat's Deepgram services, LiveKit's
plugins, Pipecat's Cartesia service with its scaffolding's voice): the vendor voice
aliases (engines/pipelines/voice_aliases.py) let them speak unchanged.

Every client runs in one .venv-agents subprocess (tests/agents_helpers.py) and must get exactly
the samples ``POST /v1/audio/speech`` gives for the same text and voice (the tiny DiT engine is
deterministic, seed 0)."""

from __future__ import annotations

import aiohttp
import pytest
from agents_helpers import KEY, TEXT, needs_agents, run_client
from conftest import start_server

pytestmark = needs_agents

# client[:voice] -> the voice POST /v1/audio/speech is asked for
CLIENTS = {
    "cartesia-bytes": "default",
    "cartesia-sse": "default",
    "elevenlabs-convert": "default",
    "elevenlabs-with-timestamps": "default",
    "deepgram-sdk:aura-2-thalia-en": "aura-2-thalia-en",  # Deepgram's documented default voice
    "pipecat-deepgram-http": "aura-2-helena-en",  # its default voice, unchanged
    "pipecat-deepgram": "aura-2-helena-en",  # the socket, its default voice
    "livekit-elevenlabs": "hpp4J3VqNfWAUOO0d1Us",  # the plugins' defaults, unchanged
    "livekit-cartesia": "f786b574-daa5-4673-aa0c-cbe3e8534c02",
    "livekit-deepgram": "aura-2-andromeda-en",
    "pipecat-cartesia:86e30c1d-714b-4074-a1f2-1cb6b552fb49": "86e30c1d-714b-4074-a1f2-1cb6b552fb49",
    "cartesia-bytes:f786b574-daa5-4673-aa0c-cbe3e8534c02": "f786b574-daa5-4673-aa0c-cbe3e8534c02",
    "elevenlabs-convert:21m00Tcm4TlvDq8ikWAM": "21m00Tcm4TlvDq8ikWAM",
}


async def speech_samples(url: str, voice: str) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/audio/speech", headers={"Authorization": f"Bearer {KEY}"},
                             json={"input": TEXT, "voice": voice, "response_format": "pcm"}) as response:
            assert response.status == 200, await response.text()
            return len(await response.read()) // 2


async def test_sdk_http_calls_and_default_voices_match_speech(engine, tmp_path):
    server = await start_server(engine, tmp_path / "data", api_keys=(KEY,))
    try:
        results = await run_client(",".join(CLIENTS), server.url)
        expected = {voice: await speech_samples(server.url, voice) for voice in set(CLIENTS.values())}
    finally:
        await server.stop()
    # the aliases land on voices of the model, not all on one
    assert len(set(expected.values())) > 1, expected
    for spec, voice in CLIENTS.items():
        result = results[spec]
        assert result["sample_rate"] == 24000 and result["peak"] > 0.01, (spec, result)
        assert result["bytes"] // 2 == expected[voice], (spec, result["bytes"] // 2, expected[voice])
        assert not result.get("timed"), spec  # no aligner: no times invented
    assert results["cartesia-sse"]["events"][-1] == "done"
    assert {"TTSStartedFrame", "TTSAudioRawFrame", "TTSStoppedFrame"} <= set(results["pipecat-deepgram-http"]["events"])


async def test_sdk_http_timestamps(aligned_engine, tmp_path):
    """With an aligner the SDK calls that ask for timestamps get the words of the text, in
    order, at non-decreasing times from the start of the audio (Cartesia: words; ElevenLabs:
    characters, which join back into the text)."""
    from engines.pipelines.aligner.words import split_words

    server = await start_server(aligned_engine, tmp_path / "data", api_keys=(KEY,))
    try:
        results = await run_client("cartesia-sse,elevenlabs-with-timestamps", server.url)
        expected = await speech_samples(server.url, "default")
    finally:
        await server.stop()
    words = results["cartesia-sse"]["timed"]
    assert [w for w, _ in words] == split_words(TEXT, "english"), words
    assert [s for _, s in words] == sorted(s for _, s in words)
    assert "timestamps" in results["cartesia-sse"]["events"]
    chars = results["elevenlabs-with-timestamps"]["timed"]
    assert "".join(c for c, _ in chars).strip() == TEXT, chars
    starts = [s for _, s in chars]
    assert starts == sorted(starts) and starts[-1] <= expected / 24000
    for spec in results:
        assert results[spec]["bytes"] // 2 == expected, spec


@pytest.mark.parametrize("voice", ["aura-2-helena-en", "hpp4J3VqNfWAUOO0d1Us", "hpp4j3vqnfwauoo0d1us"])
async def test_vendor_voice_names_are_listed_aliases(server, voice):
    """``/v1/voices`` lists the vendor names beside OpenAI's, each on a voice of the model (any case)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/v1/voices") as response:
            listed = await response.json()
        async with http.post(f"{server.url}/v1/audio/speech",
                             json={"input": "Hi.", "voice": voice, "response_format": "pcm"}) as response:
            assert response.status == 200
    aliases = {name.lower(): target for name, target in listed["aliases"].items()}
    assert aliases[voice.lower()] in listed["voices"] and aliases["alloy"] in listed["voices"]
