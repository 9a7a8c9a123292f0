"""Voice-agent SDK clients, unmodified, pointed at a streamvox server (run with .venv-agents'
python by tests/service/ws/dialects/test_dialects_sdks.py and test_dialects_http_sdks.py;
never imported by the project).

    python tests/agents_clients.py CLIENT BASE_URL KEY [VOICE]
    python tests/agents_clients.py CLIENT[:VOICE],CLIENT[:VOICE],... BASE_URL KEY

Each sends text through the SDK (in pieces where the SDK streams text in) and prints one JSON
line: the audio it got back (bytes of PCM16 at 24 kHz, sample rate, peak), the events it saw
and the word timestamps it was given (``timed``: [text, start s] in the SDK's own terms; empty
when the server sent none). VOICE: the voice the client names; absent, the SDK's own default
where it has one (LiveKit's ElevenLabs plugin, Pipecat's Deepgram services). Several clients,
comma separated, run one after the other in this one process (the SDKs are imported once) and
print one JSON object of their results by CLIENT[:VOICE].
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

PIECES = ["Hello there. ", "How are ", "you today? ", "Fine, thanks."]
TEXT = "".join(PIECES)


def summary(pcm16: bytes, rate: int, **extra) -> dict:
    audio = np.frombuffer(pcm16[: len(pcm16) // 2 * 2], dtype="<i2").astype(np.float32) / 32768
    return {"bytes": len(pcm16), "sample_rate": rate, "peak": float(np.abs(audio).max()) if audio.size else 0.0,
            **extra}


async def livekit_stream(tts) -> dict:
    stream = tts.stream()
    for piece in PIECES:
        stream.push_text(piece)
    stream.flush()
    stream.end_input()
    pcm, rate, frames, timed = bytearray(), 0, 0, []
    async for event in stream:
        pcm += bytes(event.frame.data)
        rate = event.frame.sample_rate
        frames += 1
        for word in event.frame.userdata.get("lk.timed_transcripts") or []:
            timed.append([str(word), getattr(word, "start_time", None)])
    await stream.aclose()
    return summary(bytes(pcm), rate, frames=frames, timed=timed)


async def livekit(kind: str, base: str, key: str, voice: str | None) -> dict:
    import aiohttp
    from livekit.plugins import cartesia, deepgram, elevenlabs

    async with aiohttp.ClientSession() as http:
        if kind == "livekit-elevenlabs":
            voice_id = {"voice_id": voice} if voice else {}  # absent: the plugin's DEFAULT_VOICE_ID
            tts = elevenlabs.TTS(api_key=key, base_url=base + "/v1", encoding="pcm_24000", http_session=http,
                                 **voice_id)
        elif kind == "livekit-cartesia":
            named = {"voice": voice} if voice else {}  # absent: the plugin's TTSDefaultVoiceId
            tts = cartesia.TTS(api_key=key, base_url=base, encoding="pcm_s16le", sample_rate=24000,
                               http_session=http, **named)
        else:
            named = {"model": voice} if voice else {}  # absent: the plugin's default model (voice)
            tts = deepgram.TTS(api_key=key, base_url=base + "/v1/speak", sample_rate=24000, http_session=http,
                               **named)
        try:
            return await livekit_stream(tts)
        finally:
            await tts.aclose()


async def elevenlabs_sdk(base: str, key: str) -> dict:
    """The ``elevenlabs`` SDK's realtime helper: text pieces in, audio bytes out over stream-input."""
    from elevenlabs.client import ElevenLabs

    client = ElevenLabs(api_key=key, base_url=base)
    chunks = client.text_to_speech.convert_realtime(voice_id="default", text=iter(PIECES),
                                                    model_id="eleven_flash_v2_5", output_format="pcm_24000")
    pcm = await asyncio.to_thread(lambda: b"".join(chunks))
    return summary(pcm, 24000)


async def cartesia_sdk(kind: str, base: str, key: str, voice: str) -> dict:
    """The ``cartesia`` SDK's HTTP calls: ``tts.generate`` (POST /tts/bytes) and ``tts.generate_sse``
    (POST /tts/sse, with word timestamps asked for)."""
    from cartesia import AsyncCartesia

    client = AsyncCartesia(api_key=key, base_url=base)
    fmt = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}
    if kind == "cartesia-bytes":
        response = await client.tts.generate(model_id="sonic-3", transcript=TEXT, voice={"mode": "id", "id": voice},
                                             output_format=fmt, language="en")
        return summary(await response.read(), 24000)
    pcm, timed, events = bytearray(), [], []
    stream = await client.tts.generate_sse(model_id="sonic-3", transcript=TEXT, voice={"mode": "id", "id": voice},
                                           output_format=fmt, add_timestamps=True, context_id="turn-1")
    async for event in stream:
        events.append(event.type)
        if event.type == "chunk":
            pcm += event.audio or b""
        elif event.type == "timestamps":
            timed += [[w, s] for w, s in zip(event.word_timestamps.words, event.word_timestamps.start)]
    return summary(bytes(pcm), 24000, events=events, timed=timed)


async def elevenlabs_http(kind: str, base: str, key: str, voice: str) -> dict:
    """The ``elevenlabs`` SDK's HTTP calls: ``text_to_speech.convert`` (POST /v1/text-to-speech/{voice})
    and ``convert_with_timestamps`` (POST …/with-timestamps)."""
    import base64

    from elevenlabs.client import AsyncElevenLabs

    client = AsyncElevenLabs(api_key=key, base_url=base)
    if kind == "elevenlabs-convert":
        pcm = bytearray()
        async for chunk in client.text_to_speech.convert(voice, text=TEXT, model_id="eleven_flash_v2_5",
                                                         output_format="pcm_24000"):
            pcm += chunk
        return summary(bytes(pcm), 24000)
    answer = await client.text_to_speech.convert_with_timestamps(voice, text=TEXT, model_id="eleven_flash_v2_5",
                                                                 output_format="pcm_24000")
    alignment = answer.alignment
    timed = ([[c, s] for c, s in zip(alignment.characters, alignment.character_start_times_seconds)]
             if alignment is not None else [])
    return summary(base64.b64decode(answer.audio_base_64), 24000, timed=timed)


async def deepgram_sdk(base: str, key: str, voice: str) -> dict:
    """The ``deepgram-sdk``'s ``speak.v1.audio.generate`` (POST /v1/speak)."""
    from deepgram import AsyncDeepgramClient
    from deepgram.environment import DeepgramClientEnvironment

    where = DeepgramClientEnvironment(base=base, production=base.replace("http", "ws", 1), agent=base, agent_rest=base)
    client = AsyncDeepgramClient(api_key=key, environment=where)
    pcm = bytearray()
    async for chunk in client.speak.v1.audio.generate(text=TEXT, model=voice, encoding="linear16", container="none",
                                                      sample_rate=24000):
        pcm += chunk
    return summary(bytes(pcm), 24000)


async def pipecat(kind: str, base: str, key: str, voice: str | None) -> dict:
    """A minimal Pipecat pipeline: text frames -> the TTS service -> a sink that keeps the audio."""
    import aiohttp
    from pipecat.frames.frames import EndFrame, TTSAudioRawFrame, TTSSpeakFrame, TTSTextFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

    http = aiohttp.ClientSession()
    if kind == "pipecat-elevenlabs":
        from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

        tts = ElevenLabsTTSService(api_key=key, url=base.replace("http", "ws", 1), sample_rate=24000,
                                   settings=ElevenLabsTTSService.Settings(voice=voice or "default"))
    elif kind == "pipecat-cartesia":
        from pipecat.services.cartesia.tts import CartesiaTTSService

        tts = CartesiaTTSService(api_key=key, url=base.replace("http", "ws", 1) + "/tts/websocket", sample_rate=24000,
                                 settings=CartesiaTTSService.Settings(voice=voice or "default"))
    elif kind == "pipecat-deepgram":  # no voice given: its default, aura-2-helena-en
        from pipecat.services.deepgram.tts import DeepgramTTSService

        tts = DeepgramTTSService(api_key=key, base_url=base.replace("http", "ws", 1), sample_rate=24000)
    else:
        from pipecat.services.deepgram.tts import DeepgramHttpTTSService

        tts = DeepgramHttpTTSService(api_key=key, aiohttp_session=http, base_url=base, sample_rate=24000)

    pcm = bytearray()
    events: list[str] = []
    timed: list = []

    class Sink(FrameProcessor):
        async def process_frame(self, frame, direction: FrameDirection):
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                pcm.extend(frame.audio)
            if isinstance(frame, TTSTextFrame) and frame.pts:  # word frames timed by the server's timestamps
                timed.append([frame.text, frame.pts / 1e9])
            events.append(type(frame).__name__)
            await self.push_frame(frame, direction)

    task = PipelineTask(Pipeline([tts, Sink()]), params=PipelineParams(audio_out_sample_rate=24000))
    await task.queue_frames([TTSSpeakFrame(" ".join(p.strip() for p in PIECES)), EndFrame()])
    try:
        await asyncio.wait_for(PipelineRunner(handle_sigint=False).run(task), 120)
    finally:
        await http.close()
    return summary(bytes(pcm), 24000, events=sorted(set(events)), timed=timed)


async def run(kind: str, base: str, key: str, voice: str | None = None) -> dict:
    if kind.startswith("livekit-"):
        result = await livekit(kind, base, key, voice)
    elif kind == "elevenlabs-sdk":
        result = await elevenlabs_sdk(base, key)
    elif kind.startswith("cartesia-"):
        result = await cartesia_sdk(kind, base, key, voice or "default")
    elif kind.startswith("elevenlabs-"):
        result = await elevenlabs_http(kind, base, key, voice or "default")
    elif kind == "deepgram-sdk":
        result = await deepgram_sdk(base, key, voice or "default")
    else:
        result = await pipecat(kind, base, key, voice)
    return result


async def main(kinds: str, base: str, key: str, voice: str | None = None) -> None:
    if "," not in kinds:
        print(json.dumps(await run(kinds, base, key, voice)))
        return
    results = {}
    for spec in kinds.split(","):
        kind, _, named = spec.partition(":")
        results[spec] = await run(kind, base, key, named or None)
    print(json.dumps(results))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
