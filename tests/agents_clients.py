"""Voice-agent SDK clients, unmodified, pointed at a streamvox server (run with .venv-agents'
python by tests/service/ws/dialects/test_dialects_sdks.py; never imported by the project).

    python tests/agents_clients.py CLIENT BASE_URL KEY

Each sends text in pieces through the SDK and prints one JSON line: the audio it got back
(bytes, sample rate, peak), the events it saw and the word timestamps it was given
(``timed``: [text, start s] in the SDK's own terms; empty when the server sent none)
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

PIECES = ["Hello there. ", "How are ", "you today? ", "Fine, thanks."]


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


async def livekit(kind: str, base: str, key: str) -> dict:
    import aiohttp
    from livekit.plugins import cartesia, deepgram, elevenlabs

    async with aiohttp.ClientSession() as http:
        if kind == "livekit-elevenlabs":
            tts = elevenlabs.TTS(api_key=key, voice_id="default", base_url=base + "/v1", encoding="pcm_24000",
                                 http_session=http)
        elif kind == "livekit-cartesia":
            tts = cartesia.TTS(api_key=key, voice="default", base_url=base, encoding="pcm_s16le", sample_rate=24000,
                               http_session=http)
        else:
            tts = deepgram.TTS(api_key=key, model="aura-2-default-en", base_url=base + "/v1/speak",
                               sample_rate=24000, http_session=http)
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


async def pipecat(kind: str, base: str, key: str) -> dict:
    """A minimal Pipecat pipeline: text frames -> the TTS service -> a sink that keeps the audio."""
    from pipecat.frames.frames import EndFrame, TTSAudioRawFrame, TTSSpeakFrame, TTSTextFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

    if kind == "pipecat-elevenlabs":
        from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

        tts = ElevenLabsTTSService(api_key=key, voice_id="default", url=base.replace("http", "ws", 1),
                                   sample_rate=24000)
    else:
        from pipecat.services.cartesia.tts import CartesiaTTSService

        tts = CartesiaTTSService(api_key=key, voice_id="default", url=base.replace("http", "ws", 1) + "/tts/websocket",
                                 sample_rate=24000)

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
    await asyncio.wait_for(PipelineRunner(handle_sigint=False).run(task), 120)
    return summary(bytes(pcm), 24000, events=sorted(set(events)), timed=timed)


async def main(kind: str, base: str, key: str) -> None:
    if kind.startswith("livekit-"):
        result = await livekit(kind, base, key)
    elif kind == "elevenlabs-sdk":
        result = await elevenlabs_sdk(base, key)
    else:
        result = await pipecat(kind, base, key)
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
