"""A voice-agent dialect's HTTP speech request on the same context core as its socket.

ElevenLabs' ``POST /v1/text-to-speech/{voice}``, Cartesia's ``POST /tts/bytes`` and Deepgram's
``POST /v1/speak`` carry the whole text in one body and answer with the audio. Each is one
:class:`~service.ws.contexts.Context` - the session core every socket stands on: sentences cut
and spoken in order, the next one submitted while this one speaks, voices, work limits,
cancellation when the client leaves, word timestamps - that speaks the text as one round and
ends. Its audio goes into one HTTP response through one encoder (one WAV header, one MP3
stream), so the bytes are those of ``POST /v1/audio/speech`` for the same text and voice.

A dialect subclasses :class:`HttpSpeech`: :meth:`parse` turns its body and query into a
:class:`Speech`, and the ``write_*`` methods frame the audio in its response (raw bytes,
server-sent events, JSON lines, one JSON object). Errors before the first audio are HTTP errors,
which the error middleware writes in the dialect's shape (its ``ForeignApi``,
service/http/middleware.py); after it, :meth:`write_failure` says so in-stream where the framing can.

    class MySpeech(HttpSpeech):
        ENDPOINT = "/my/speech"
        async def parse(self, body): return Speech(text=body["text"], voice="default", encoding="pcm_s16le")
    app.router.add_post(MySpeech.ENDPOINT, handler(MySpeech))
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from service.access.limits import client_identity
from service.errors import ApiError
from service.http.body import read_json_object
from service.state import COUNTED, REQUEST_ID, STATE_KEY, AppState
from service.synthesis.audio import StreamEncoder
from service.synthesis.params import check_text
from service.synthesis.plan import check_work
from service.ws.contexts import Context, ContextSocket
from service.ws.events import SessionClosed
from service.ws.dialects.wire_audio import wav_header

# The status of a context error that ends a request before its first audio (others: 400).
ERROR_STATUS = {"too_much_work": 413, "overloaded": 429, "unavailable": 503, "shutting_down": 503,
                "database_unavailable": 503, "synthesis_failed": 500}
CONTEXT = "http"
CLIENT_CHECK_S = 0.2  # how often a request looks for its client (a write would notice only at its next audio)


@dataclass
class Speech:
    """What one HTTP speech request asks for, in streamvox's terms."""

    text: str
    voice: str
    encoding: str  # a wire encoding (service/ws/dialects/wire_audio.py)
    rate: int = 24000
    bit_rate: int | None = None  # mp3
    wav: bool = False  # a WAV header before the samples
    timestamps: bool = False  # word timestamps (with --aligner)
    speed: object = None  # the dialect's speed field, checked by the session core (None: 1.0)
    text_field: str = "text"  # the text's name in the dialect's body, for error messages


class HttpSpeech(ContextSocket):
    """One HTTP speech request of a dialect: a ContextSocket without a socket."""

    CONTENT_TYPE = "application/octet-stream"
    RESPOND_AT_END = False  # True: the status line waits for the whole audio (one JSON answer)
    TEXT_STREAMING = False  # the whole text is here: sentences

    def __init__(self, request: web.Request, state: AppState):
        super().__init__(request, None, state)
        self.response: web.StreamResponse | None = None
        self.encoder: StreamEncoder | None = None
        self.speech: Speech | None = None
        self.failure: ApiError | None = None
        self.finished = asyncio.Event()

    # -- what a dialect provides (its errors' body: its ForeignApi, service/http/middleware.py) --
    async def parse(self, body: dict) -> Speech:
        """The request (body and query) in streamvox's terms; ApiError(4xx) for what the dialect refuses."""
        raise NotImplementedError

    def content_type(self) -> str:
        return self.CONTENT_TYPE

    async def write_audio(self, data: bytes) -> None:
        """``data``: the next encoded bytes (never empty)."""
        await self.response.write(data)

    async def write_alignment(self, alignment, offset_ms: float) -> None:
        """An utterance's word times (``offset_ms``: where it starts in the response's audio)."""

    async def write_end(self) -> None:
        """Everything was spoken: the dialect's last message, if it has one."""

    async def write_failure(self, code: str, message: str) -> None:
        """The request failed after its first audio (raw audio cannot say so: it just ends)."""

    def release(self) -> None:
        """The request ended, however it did: free what the dialect holds for it."""

    # -- the context's events ------------------------------------------------------------
    async def start(self) -> None:
        """The status line and headers, then the WAV header: at the first audio."""
        if self.response is not None:
            return
        self.response = web.StreamResponse(headers={"Content-Type": self.content_type(), "Cache-Control": "no-cache",
                                                    **self.state.audio_headers()})
        await self.response.prepare(self.request)
        if self.speech.wav:
            await self.write_audio(wav_header(self.speech.encoding, self.speech.rate))

    async def send(self, write, *args) -> None:
        """A ``write_*`` call; a client that went away ends the request (the speaker stops quietly)."""
        try:
            await write(*args)
        except (ConnectionError, RuntimeError) as exc:
            self.outcome = "client_closed"
            self.close_contexts()
            raise SessionClosed() from exc

    async def audio(self, context: Context, pcm: np.ndarray) -> None:
        data = await self.encoder.encode_async(pcm)  # mp3 / resampling off the loop
        if not self.RESPOND_AT_END:
            await self.send(self.start)
        if data:  # the resampler or the MP3 frame may hold the chunk's samples back
            await self.send(self.write_audio, data)

    async def alignment(self, context: Context, alignment, offset_ms: float) -> None:
        await self.send(self.write_alignment, alignment, offset_ms)

    async def utterance_done(self, context: Context, cancelled: bool, failed: bool) -> None:
        if failed:
            await self.context_error(context, "synthesis_failed", f"synthesis failed (request id "
                                                                  f"{self.request[REQUEST_ID]})")

    async def round_done(self, context: Context, label: object) -> None:
        if self.failure is None:
            await self.send(self.start)
            tail = await self.encoder.finish_async()
            if tail:
                await self.send(self.write_audio, tail)
            await self.send(self.write_end)
        self.finished.set()

    async def context_error(self, context: Context | None, code: str, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = ApiError(ERROR_STATUS.get(code, 400), code, message)
        if self.response is not None:
            try:
                await self.write_failure(code, message)
            except (ConnectionError, RuntimeError):
                pass
        self.close_contexts()

    def close_contexts(self) -> None:
        self.closed = True
        self.cancel_all()
        self.finished.set()

    async def close(self, close_code: int = 0, reason: str = "") -> None:
        self.close_contexts()

    async def fatal(self, code: str, message: str, close_code: int) -> None:
        """The drain's grace ran out (or the engine is gone): the request ends with this error."""
        self.outcome = code
        await self.context_error(None, code, message)

    # -- the request ---------------------------------------------------------------------
    async def watch_client(self) -> None:
        """A client that goes away ends its request at once, its engine work cancelled: also one
        that is sent nothing until the end (one JSON answer), or before its first audio."""
        while not self.finished.is_set():
            transport = self.request.transport
            if transport is None or transport.is_closing():
                self.outcome = "client_closed"
                self.close_contexts()
                return
            await asyncio.sleep(CLIENT_CHECK_S)

    async def speak(self, speech: Speech) -> web.StreamResponse:
        """Speak ``speech`` as one round of one context; the response once it has all been sent."""
        self.speech = speech
        self.encoder = StreamEncoder(speech.encoding, speech.rate, speech.bit_rate)
        watcher = asyncio.create_task(self.watch_client())
        try:
            return await self._speak_text(speech)
        finally:
            watcher.cancel()

    async def _speak_text(self, speech: Speech) -> web.StreamResponse:
        context = self.open_context(CONTEXT)
        await context.configure(speech.voice, speed=speech.speed, timestamps=speech.timestamps)
        if self.failure is None:
            # the whole text, up front
            check_work(self.state.engine, speech.text, context.core.params, self.state.settings)
            await context.add_text(speech.text)
        if self.failure is None:
            await context.flush("end")
            await self.finished.wait()
        if self.response is None:
            if self.outcome == "client_closed":
                raise ApiError(499, "client_closed", "the client went away")
            if self.failure is not None:
                raise self.failure
            await self.start()  # (no audio at all: an empty, well-formed answer)
        await self.response.write_eof()
        return self.response


async def serve_http(request: web.Request, dialect: type[HttpSpeech]) -> web.StreamResponse:
    """``dialect``'s speech request: admission, the per-key rate and stream limits, its body,
    then the context speaks. Its key was checked with its API's (service/http/middleware.py)."""
    state = request.app[STATE_KEY]
    state.check_admission()
    identity = client_identity(request, state.api_keys, websocket=True)  # the key the dialect's header carried
    state.limits.check_rate(identity)
    body = await read_json_object(request)
    speech = dialect(request, state)
    parsed = await speech.parse(body)
    check_text(parsed.text_field, parsed.text, state.settings.max_input_chars)  # as every route checks its text
    state.limits.open_stream(identity)
    state.streams.add(speech)  # the drain waits for it, then aborts it
    try:
        return await speech.speak(parsed)
    except ConnectionError:  # (the client went away mid-answer)
        if speech.response is None:
            raise ApiError(499, "client_closed", "the client went away") from None
        state.metrics.count(dialect.ENDPOINT, "client_closed")
        request[COUNTED] = True
        return speech.response
    finally:
        state.streams.discard(speech)
        speech.close_contexts()
        speech.release()
        speakers = [c.speaker for c in speech.contexts.values() if c.speaker is not None]
        await asyncio.gather(*speakers, return_exceptions=True)
        state.limits.close_stream(identity)


def handler(dialect: type[HttpSpeech]):
    """The aiohttp handler of ``dialect``'s route."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await serve_http(request, dialect)

    return handle


__all__ = ["HttpSpeech", "Speech", "handler", "serve_http"]
