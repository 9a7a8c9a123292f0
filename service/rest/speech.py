"""``POST /v1/audio/speech``: OpenAI-compatible speech, as a file, a byte stream or SSE.

A route of the one HTTP speech service (service/speech.py): it parses its body and writes its
wire format; admission, the voice, the plan, the stream and the client's leaving are the service's.
"""

from __future__ import annotations

import asyncio
import base64
import json

from aiohttp import web

from engines.contract import SAMPLES_PER_FRAME
from service.errors import ApiError
from service.speech import SpeechDone, SpeechOrder, SpeechRoute, serve_speech
from service.synthesis.audio import CONTENT_TYPES, STREAMABLE, StreamEncoder
from service.synthesis.chunks import behind_event, truncated_event
from service.synthesis.events import AlignmentReady, Audio, StreamBehind, UtteranceTruncated
from service.synthesis.params import SpeechBody, check_model, parse_body
from service.synthesis.spool import AudioSpool
from service.synthesis.timestamps import words_json
from service.voices.clones import voice_for

TRUNCATED_HEADER = "X-Streamvox-Truncated"


def delivery(body: SpeechBody) -> str | None:
    """How the audio goes out: ``audio`` (bytes as generated), ``sse`` or None (one file).
    ``stream_format`` decides when given; else vllm-omni's ``stream`` (true: SSE, false: one
    file); else OpenAI's default: streamed wherever the format can be encoded incrementally."""
    if body.stream_format is not None:
        return body.stream_format
    if body.stream is not None:
        return "sse" if body.stream else None
    return "audio" if body.response_format in STREAMABLE else None


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


class OpenAISpeech(SpeechRoute):
    """A whole file (encoded as it arrives into a spool: memory up to a threshold, then a temporary
    file, its length in the headers), the bytes as they are encoded, or server-sent events."""

    ENDPOINT = "/v1/audio/speech"

    def __init__(self, request: web.Request, state):
        super().__init__(request, state)
        self.body: SpeechBody | None = None
        self.delivery: str | None = None
        self.encoder: StreamEncoder | None = None  # streamed
        self.spool: AudioSpool | None = None  # a whole file
        self.size = 0  # the whole file's bytes, once finished
        self.truncated: list[str] = []  # why utterances were ended early, in order (a whole file's header)

    async def parse(self, body: dict) -> SpeechOrder:
        settings = self.state.settings
        self.body = parse_body(SpeechBody, body, settings.max_input_chars)
        check_model(self.body.model, settings.checkpoint)
        self.delivery = delivery(self.body)
        fmt, rate = self.body.response_format, self.body.sample_rate
        if self.delivery is None:
            self.respond_at_end = True
            self.spool = AudioSpool(fmt, settings.whole_file_memory_bytes, rate)
        else:
            self.encoder = StreamEncoder(fmt, rate)
        voice = await voice_for(self.request, self.body.voice, self.body)  # ref_audio or a saved voice: its features
        return SpeechOrder(self.body.input, self.body.params, voice, streamed=self.delivery is not None,
                           timestamps=self.body.timestamps and self.delivery == "sse")

    @property
    def sse(self) -> bool:
        return self.delivery == "sse"

    def headers(self) -> dict[str, str]:
        fmt = self.body.response_format
        if self.spool is not None:
            headers = {"Content-Type": CONTENT_TYPES[fmt], "Content-Length": str(self.size)}
            if self.truncated:  # utterances the talker ended early (a runaway): their reasons, in order
                headers[TRUNCATED_HEADER] = ",".join(self.truncated)
            return headers
        return {"Content-Type": "text/event-stream" if self.sse else CONTENT_TYPES[fmt], "Cache-Control": "no-cache"}

    async def begin(self) -> None:
        if self.encoder is not None:
            await self.send(self.encoder.header())

    async def send(self, data: bytes) -> None:
        if data:
            await self.response.write(_sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                                      if self.sse else data)

    async def audio(self, event: Audio) -> None:
        if self.spool is not None:
            await asyncio.to_thread(self.spool.write, event.pcm)  # encoding must not block the loop
        else:
            await self.send(await self.encoder.encode_async(event.pcm))  # mp3 / opus / aac off the loop

    async def stream_behind(self, event: StreamBehind) -> None:
        if self.sse:  # (raw audio cannot carry it: /metrics counts it for every stream)
            await self.response.write(_sse(behind_event(event.gap_s, event.behind_s)))

    async def utterance_truncated(self, event: UtteranceTruncated) -> None:
        if self.spool is not None:
            self.truncated.append(event.reason)
        elif self.sse:  # (raw audio: /metrics counts it)
            await self.response.write(_sse(truncated_event(event.reason)))

    async def alignment(self, event: AlignmentReady) -> None:
        """Each utterance's word times: SSE sends the whole text's at the end (``done``)."""

    async def done(self, event: SpeechDone) -> None:
        if self.spool is not None:
            self.size = await asyncio.to_thread(self.spool.finish)
            await self.start()
            while block := await asyncio.to_thread(self.spool.read):
                await self.response.write(block)
            return
        await self.start()
        await self.send(await self.encoder.finish_async())
        if not self.sse:
            return
        if event.alignment is not None:
            await self.response.write(_sse({"type": "speech.audio.alignment", "text": event.alignment.text,
                                            "language": event.alignment.language,
                                            "words": words_json(event.alignment)}))
        done = {"type": "speech.audio.done", "usage": usage(self.body.input, event.samples,
                                                             self.state.engine.info.sample_rate)}
        if event.underruns:
            done["behind_s"] = round(event.behind_s, 3)
        await self.response.write(_sse(done))

    async def failed(self, error: ApiError) -> None:
        if self.sse:
            await self.response.write(_sse({"type": "error", "error": {"code": error.code, "message": error.message}}))

    def release(self) -> None:
        if self.spool is not None:
            self.spool.close()  # quick: frees memory or unlinks a temp file


async def create_speech(request: web.Request) -> web.StreamResponse:
    return await serve_speech(request, OpenAISpeech)


def usage(text: str, samples: int, sample_rate: int) -> dict:
    """SSE ``speech.audio.done`` usage with OpenAI's names: input tokens = the input's
    characters, output tokens = the codec frames of the audio (12.5 per second); our own
    older names stay beside them."""
    frames = -(-samples // SAMPLES_PER_FRAME)
    return {"input_tokens": len(text), "output_tokens": frames, "total_tokens": len(text) + frames,
            "input_characters": len(text), "output_samples": samples,
            "audio_seconds": round(samples / sample_rate, 3)}
