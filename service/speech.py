"""One HTTP speech service: every route that speaks one text into one HTTP response - OpenAI's
``POST /v1/audio/speech`` (service/rest/speech.py) and the voice-agent vendors' HTTP calls
(service/ws/dialects/*_http.py) - is a :class:`SpeechRoute` served by :func:`serve_speech`.

A route only parses its body into a :class:`SpeechOrder` (its voice resolved) and writes its wire format from the
events of the speech (service/synthesis/events.py: every one of them, audio, the listener
running behind, a truncated utterance, word times; then :class:`SpeechDone`, or its failure).
The rest is done here, once, the same for every route:

    admission (the drain), the caller's rate limit and stream caps, the JSON body;
    the voice as the route resolved it, once (service/voices/clones.py);
    the plan (service/synthesis/plan.py: utterances, frame budgets, on a thread for long text),
    checked against the work limits; the stream (service/synthesis/submit.py);
    the drain's abort, a client that goes away (its engine work cancelled at once);
    a failure before the first byte as the HTTP error (in the route's API's shape: its
    ``ForeignApi``, service/http/middleware.py), after it in-stream (``SpeechRoute.failed``).

The status line goes out with the first audio (a request that fails before any audio gets its
HTTP error), or at the end for a route that answers once everything was spoken
(``respond_at_end``: a whole file, one JSON object).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web

from engines.contract import Alignment, AudioChunk, Priority
from service.errors import ApiError, capacity_error, is_capacity_error
from service.http.body import read_work_request
from service.state import COUNTED, REQUEST_ID, AppState
from service.synthesis.chunks import ChunkStream, PlaybackClock
from service.synthesis.events import AlignmentReady, Audio, SpeechSink, StreamBehind, UtteranceTruncated
from service.synthesis.params import SynthesisParams
from service.synthesis.plan import check_work, off_loop
from service.synthesis.sequence import UtteranceSequence
from service.synthesis.submit import open_stream
from service.voices.clones import Voice

log = logging.getLogger("streamvox.speech")
CLIENT_CHECK_S = 0.2  # how often a request looks for its client (a write would notice only at its next audio)


@dataclass(frozen=True)
class SpeechOrder:
    """What one HTTP speech request asks for, in streamvox's terms (a route's :meth:`SpeechRoute.parse`)."""

    text: str
    params: SynthesisParams  # validated
    voice: Voice  # resolved once, by the route (service/voices/clones.py): a vendor refuses in its own words
    streamed: bool = True  # its listener plays it as it comes: realtime, a stream under the key's cap, a clock
    timestamps: bool = False  # word times wanted (with an aligner: AlignmentReady events and SpeechDone's)
    sentences: bool = False  # one utterance per sentence at least (the vendors', as their sockets speak)


@dataclass(frozen=True)
class SpeechDone:
    """Everything was spoken."""

    samples: int  # of audio, at the engine's rate
    alignment: Alignment | None  # the whole text's word times, when asked for and aligned
    behind_s: float  # silence a listener playing it as it came heard inside it
    underruns: int


class SpeechRoute(SpeechSink):
    """An HTTP speech route: its body in (:meth:`parse`), its wire format out (the events)."""

    ENDPOINT = ""
    FOREIGN_API = False  # its key comes in its vendor's header (service/http/middleware.py ForeignApi)

    def __init__(self, request: web.Request, state: AppState):
        self.request = request
        self.state = state
        self.response: web.StreamResponse | None = None
        self.respond_at_end = False  # the status line waits for the whole audio (set by ``parse``)

    async def parse(self, body: dict) -> SpeechOrder:
        """The request (body, query, path) in streamvox's terms; ApiError(4xx) for what the route refuses."""
        raise NotImplementedError

    def headers(self) -> dict[str, str]:
        """The response's headers (its content type), when it starts."""
        raise NotImplementedError

    async def begin(self) -> None:
        """The response started: what comes before the audio (a WAV header)."""

    async def start(self) -> None:
        """The status line and headers, once: at the first audio (or when a route answering at
        the end is ready to)."""
        if self.response is None:
            self.response = web.StreamResponse(headers={**self.headers(), **self.state.audio_headers()})
            await self.response.prepare(self.request)
            await self.begin()

    async def done(self, event: SpeechDone) -> None:
        """Everything was spoken: the rest of the answer."""
        raise NotImplementedError

    async def failed(self, error: ApiError) -> None:
        """It failed after the response started: say so where the wire format can."""

    def release(self) -> None:
        """The request ended, however it did: free what the route holds for it."""


class _Speaking:
    """One request's speech, as the drain (service/state.py) and the client watch see it."""

    busy = True

    def __init__(self, stream: ChunkStream | UtteranceSequence):
        self.stream = stream
        self.aborted: ApiError | None = None  # the drain's grace ran out
        self.client_gone = False

    async def abort(self, code: str, message: str) -> None:
        self.aborted = ApiError(503, code, message, headers={"Retry-After": "1"})
        self.stream.cancel()

    async def watch(self, request: web.Request) -> None:
        """A client that goes away ends its request at once, its engine work cancelled: also one that
        is sent nothing until the end, or nothing yet."""
        while True:
            if request.transport is None or request.transport.is_closing():
                self.client_gone = True
                self.stream.cancel()
                return
            await asyncio.sleep(CLIENT_CHECK_S)


async def serve_speech(request: web.Request, route_type: type[SpeechRoute]) -> web.StreamResponse:
    """``route_type``'s request, spoken (see the module docstring)."""
    state, identity, body = await read_work_request(request, foreign_api=route_type.FOREIGN_API)
    route = route_type(request, state)
    try:
        order = await route.parse(body)
        params = order.params.model_copy(update={"voice": order.voice.name})
        plan = await off_loop(order.text, check_work, state.engine, order.text, params, state.settings,
                              clone=order.voice.clone, sentences=order.sentences)
        open_, close = ((state.limits.open_stream, state.limits.close_stream) if order.streamed
                        else (state.limits.open_whole, state.limits.close_whole))
        open_(identity)  # 429 too_many_streams while the key's other streams hold their share
        try:
            # a listener plays a streamed response as it comes: notice when it falls behind real time
            clock = PlaybackClock(state.engine.info.sample_rate) if order.streamed else None
            stream = open_stream(state, plan, request[REQUEST_ID], Priority.REALTIME if order.streamed else Priority.BATCH,
                                 tenant=identity, timestamps=order.timestamps, high_water=state.settings.ws_buffer_chunks,
                                 clock=clock)
        except ApiError:
            close(identity)
            raise
        log.info("speech %s (%s): %d chars, %d utterances", request[REQUEST_ID], route_type.ENDPOINT, len(order.text),
                 len(plan.utterances))
        speaking = _Speaking(stream)
        state.streams.add(speaking)  # the drain waits for it, then aborts it
        watcher = asyncio.create_task(speaking.watch(request))
        try:
            return await _speak(route, speaking)
        except ConnectionError:  # the client went away mid-answer
            log.info("speech %s: client went away", request[REQUEST_ID])
            state.metrics.count(route_type.ENDPOINT, "client_closed")
            request[COUNTED] = True
            return route.response
        finally:
            watcher.cancel()
            state.streams.discard(speaking)
            stream.cancel()  # no-op once finished; frees the slot if the client went away
            close(identity)
    finally:
        route.release()


async def _speak(route: SpeechRoute, speaking: _Speaking) -> web.StreamResponse:
    """The stream's chunks as the route's events, then its end; the response."""
    stream = speaking.stream
    index = 0  # the utterance (part of the plan) being played
    samples = 0
    while True:
        parts_before = _parts_done(stream)
        chunk = await stream.next_chunk()
        if chunk.is_final and chunk.error and route.response is None:
            raise _failure(route, speaking, chunk)
        if chunk.pcm.size and not route.respond_at_end:
            await route.start()
        if stream.last_gap:
            await route.stream_behind(StreamBehind(index, stream.last_gap, stream.clock.behind_s))
        if chunk.pcm.size:
            samples += chunk.pcm.size
            await route.audio(Audio(index, chunk.pcm))
        if chunk.truncated and not chunk.error:  # the talker ended a runaway utterance
            await route.utterance_truncated(UtteranceTruncated(index, chunk.truncated))
        if _parts_done(stream) > parts_before:  # the chunk ended an utterance (or a pause)
            words = _part_words(stream, chunk)
            if words is not None and not chunk.error:
                await route.alignment(AlignmentReady(index, *words))
            index += 1
        if chunk.is_final:
            break
    if chunk.error:
        await route.failed(_failure(route, speaking, chunk))
    else:
        clock = stream.clock
        await route.done(SpeechDone(samples, chunk.alignment, clock.behind_s if clock else 0.0,
                                    clock.underruns if clock else 0))
        await route.start()  # (nothing spoken, nothing written yet: an empty, well-formed answer)
    await route.response.write_eof()
    return route.response


def _parts_done(stream: ChunkStream | UtteranceSequence) -> int:
    """The parts of the plan whose audio has all been read (a ChunkStream is one part)."""
    return stream.parts_done if isinstance(stream, UtteranceSequence) else int(stream.finished)


def _part_words(stream: ChunkStream | UtteranceSequence, chunk: AudioChunk) -> tuple[Alignment, float] | None:
    """The word times of the part ``chunk`` ended (from its start, in its own text) and where it
    starts on the response's clock (ms); None when it has none."""
    if isinstance(stream, UtteranceSequence):
        return stream.ended_part_words
    return (chunk.alignment, 0.0) if chunk.alignment is not None else None


def _failure(route: SpeechRoute, speaking: _Speaking, chunk: AudioChunk) -> ApiError:
    """Why the stream ended with ``chunk.error``, as the client is told."""
    request_id = route.request[REQUEST_ID]
    if speaking.client_gone:
        return ApiError(499, "client_closed", "the client went away")
    if speaking.aborted is not None:
        return speaking.aborted
    if chunk.error == "cancelled":
        return ApiError(503, "shutting_down", "the request was cancelled by the server", headers={"Retry-After": "1"})
    if is_capacity_error(chunk.error):
        log.warning("speech %s: no capacity: %s", request_id, chunk.error)
        return capacity_error()
    log.error("speech %s failed: %s", request_id, chunk.error)
    return ApiError(500, "synthesis_failed", f"synthesis failed (request id {request_id})")


def handler(route_type: type[SpeechRoute]):
    """The aiohttp handler of ``route_type``'s route."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await serve_speech(request, route_type)

    return handle


__all__ = ["SpeechDone", "SpeechOrder", "SpeechRoute", "handler", "serve_speech"]
