"""WebSocket ``/v1/audio/speech/stream``: vllm-omni's streaming-text speech protocol, so
clients written for vllm-omni's Qwen3-TTS server work unmodified.

The session machinery is ``/v1/stream``'s (service/ws/session.py on the session core: sentence
cutting, prefetch, back-pressure, limits, drain, the handshake); this module is the dialect: what
a ``session.config`` may carry, and how the core's events are named and shaped on the wire.

Client: ``session.config`` (REST fields: voice, language, instructions, response_format,
sample_rate, stream_audio, model, sampling, ref_audio / ref_text / x_vector_only_mode), ``input.text``, ``input.done`` (a flush; the
connection stays open), ``session.close``. Server: ``audio.start {utterance_index,
sentence_index, sentence_text, format, sample_rate, channels}``, binary audio,
``audio.done {utterance_index, sentence_index, total_bytes, error}``, ``session.done
{utterance_index, total_sentences}``, ``error {message, code}``. ``utterance_index``
counts flushes, ``sentence_index`` the sentences inside one. With ``stream_audio`` true the
audio is PCM16 frames as generated; otherwise one ``response_format`` file per sentence
(``wav`` by default, as vllm-omni).
"""

from __future__ import annotations

import asyncio
from typing import Literal

import numpy as np
from aiohttp import web
from pydantic import Field

from service.errors import ApiError
from service.synthesis.audio import StreamEncoder, encode_file, output_rate
from service.synthesis.params import check_model, parse
from service.synthesis.schema import SPEECH_FORMATS, Strict
from service.synthesis.events import Audio, StreamBehind
from service.ws.events import RoundDone, UtteranceDone, UtteranceStarted
from service.ws.handshake import serve
from service.ws.session import StreamSession

ENDPOINT = "/v1/audio/speech/stream"
# vllm-omni fields this endpoint does not serve: refused rather than ignored (ignoring them would
# answer with another voice than the client asked for). ref_audio / ref_text / x_vector_only_mode
# clone as on HTTP speech (service/ws/core.py SessionCore.configure).
UNSERVED_FIELDS = ("speaker_embedding",)


def encode_whole(pieces: list[np.ndarray], fmt: str, sample_rate: int | None) -> bytes:
    """A sentence's audio pieces as one ``fmt`` file (run off the event loop)."""
    return encode_file(np.concatenate(pieces), fmt, sample_rate)


class OmniConfig(Strict):
    """The fields of a ``session.config`` this dialect adds to the session's parameters."""

    response_format: Literal[SPEECH_FORMATS] = "wav"
    stream_audio: bool = False
    sample_rate: int | None = Field(None, ge=8000, le=48000)
    model: str | None = None


class OmniSession(StreamSession):
    ENDPOINT = ENDPOINT
    TEXT_STREAMING = False  # vllm-omni's protocol speaks sentences (audio.start names each one)

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, state):
        super().__init__(request, ws, state)
        self.config = OmniConfig()
        self.flush_index = 0  # vllm-omni's utterance_index: input.done flushes
        self.sentence_index = 0  # sentences inside the current flush
        self.sent_bytes = 0
        self.encoder: StreamEncoder | None = None  # stream_audio: PCM at the asked rate
        self.held: list[np.ndarray] = []  # otherwise the sentence's audio, sent as one file

    async def on_config(self, message: dict) -> None:
        refused = [name for name in UNSERVED_FIELDS if message.get(name) is not None]
        if refused:
            await self.error("unsupported_field", f"{refused[0]}: not served on this endpoint; send ref_audio "
                                                  "(+ ref_text) or a saved voice's name")
            return
        try:
            config = parse(OmniConfig, {**self.config.model_dump(), **message})
            if config.model is not None:
                check_model(config.model, self.state.settings.checkpoint)
        except ApiError as exc:
            await self.error(exc.code, exc.message)
            return
        self.config = config
        await super().on_config(message)

    # -- the core's events, in vllm-omni's names and fields ------------------------------
    async def opened(self) -> None:
        """vllm-omni sends nothing on connect."""

    async def utterance_started(self, event: UtteranceStarted) -> None:
        stream = self.config.stream_audio
        self.encoder = StreamEncoder("pcm", self.config.sample_rate) if stream else None
        self.held, self.sent_bytes = [], 0
        fmt = "pcm" if stream else self.config.response_format
        await self.send_json({"type": "audio.start", "utterance_index": self.flush_index,
                              "sentence_index": self.sentence_index, "sentence_text": event.text,
                              "format": fmt, "sample_rate": output_rate(fmt, self.config.sample_rate),
                              "channels": 1})

    async def audio(self, event: Audio) -> None:
        if self.encoder is not None:
            data = await self.encoder.encode_async(event.pcm)
            if data:
                await self.send_bytes(data)
                self.sent_bytes += len(data)
        else:
            self.held.append(np.asarray(event.pcm, dtype=np.float32))

    async def stream_behind(self, event: StreamBehind) -> None:
        if self.config.stream_audio:  # each sentence as one file: nobody plays it as it is generated
            await super().stream_behind(event)

    async def utterance_done(self, event: UtteranceDone) -> None:
        failed = bool(event.error)
        await self.flush_audio(failed)
        await self.send_json({"type": "audio.done", "utterance_index": self.flush_index,
                              "sentence_index": self.sentence_index, "total_bytes": self.sent_bytes,
                              "error": failed, "cancelled": event.cancelled})
        self.sentence_index += 1

    async def round_done(self, event: RoundDone) -> None:
        await self.send_json({"type": "session.done", "utterance_index": self.flush_index,
                              "total_sentences": self.sentence_index})
        self.flush_index += 1
        self.sentence_index = 0

    async def flush_audio(self, failed: bool) -> None:
        """The end of a sentence: the resampler's tail, or the whole sentence as one file."""
        if self.encoder is not None:
            data = await self.encoder.finish_async()
            self.encoder = None
        elif self.held and not failed:
            # A sentence may be minutes long (mp3 of 5 minutes takes seconds): encoded in a
            # thread, the event loop keeps serving every other client meanwhile.
            data = await asyncio.to_thread(encode_whole, self.held, self.config.response_format,
                                           self.config.sample_rate)
        else:
            data = b""
        self.held = []
        if data:
            await self.send_bytes(data)
            self.sent_bytes += len(data)


async def speech_stream(request: web.Request) -> web.StreamResponse:
    return await serve(request, OmniSession)
