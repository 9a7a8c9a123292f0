"""``POST /v1/audio/speech``: OpenAI-compatible speech, as a file, a byte stream or SSE."""

from __future__ import annotations

import asyncio
import base64
import json
import logging

from aiohttp import web

from engines.contract import SAMPLES_PER_FRAME, Priority
from service.access.limits import client_identity
from service.errors import ApiError, capacity_error, is_capacity_error
from service.http.admission import read_work_request
from service.state import COUNTED, REQUEST_ID, STATE_KEY
from service.synthesis.audio import CONTENT_TYPES, STREAMABLE, StreamEncoder
from service.synthesis.chunks import ChunkStream, PlaybackClock, behind_event, truncated_event
from service.synthesis.params import SpeechBody, check_model
from service.synthesis.spool import AudioSpool
from service.synthesis.submit import open_stream, prepare
from service.synthesis.timestamps import words_json
from service.voices import clones as voices

log = logging.getLogger("streamvox.speech")
TRUNCATED_HEADER = "X-Streamvox-Truncated"


def client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


class _SpeechWork:
    """An in-flight streamed response, as the drain sees it."""

    busy = True

    def __init__(self, stream: ChunkStream):
        self.stream = stream
        self.abort_code: str | None = None

    async def abort(self, code: str, message: str) -> None:
        self.abort_code = code
        self.stream.cancel()


def delivery(body: SpeechBody) -> str | None:
    """How the audio goes out: ``audio`` (bytes as generated), ``sse`` or None (one file).
    ``stream_format`` decides when given; else vllm-omni's ``stream`` (true: SSE, false: one
    file); else OpenAI's default: streamed wherever the format can be encoded incrementally."""
    if body.stream_format is not None:
        return body.stream_format
    if body.stream is not None:
        return "sse" if body.stream else None
    return "audio" if body.response_format in STREAMABLE else None


async def create_speech(request: web.Request) -> web.StreamResponse:
    state, body, plan = await read_work_request(request, SpeechBody)
    check_model(body.model, state.settings.checkpoint)
    clone = await voices.clone_for(request, body.voice, body)  # ref_audio or a saved voice -> x-vector (+ reference codes)
    text, fmt, stream_format = body.input, body.response_format, delivery(body)
    request_id = request[REQUEST_ID]
    priority = Priority.REALTIME if stream_format else Priority.BATCH
    identity = client_identity(request, state.api_keys)
    prepared = prepare(state.engine, request_id, plan, priority, clone=clone, tenant=identity,
                       timestamps=body.timestamps and stream_format == "sse")
    # a listener plays a streamed response as it comes: notice when it falls behind real time
    clock = PlaybackClock(state.engine.info.sample_rate) if stream_format is not None else None
    # Streamed responses count toward the per-key cap (429 too_many_streams while others stream);
    # whole-file ones are never capped here but count as another client's speech in flight.
    open_, close = ((state.limits.open_stream, state.limits.close_stream) if stream_format is not None
                    else (state.limits.open_whole, state.limits.close_whole))
    open_(identity)
    try:
        stream = open_stream(state, prepared, high_water=state.settings.ws_buffer_chunks, clock=clock)
    except ApiError:
        close(identity)
        raise
    log.info("speech %s: %d chars, format=%s stream=%s", request_id, len(text), fmt, stream_format)
    work = _SpeechWork(stream)
    state.streams.add(work)  # the drain waits for it, then aborts it
    try:
        if stream_format is None:
            return await _whole_file(request, stream, fmt, body.sample_rate)
        return await _streamed(request, work, fmt, stream_format, body)
    finally:
        state.streams.discard(work)
        stream.cancel()  # no-op once finished; frees the slot if the client went away
        close(identity)


def _raise_failure(request: web.Request, chunk) -> None:
    """A final chunk's error as the HTTP error (before any response byte was sent)."""
    if chunk.error == "cancelled":
        raise ApiError(503, "shutting_down", "the request was cancelled by the server", headers={"Retry-After": "1"})
    if is_capacity_error(chunk.error):
        log.warning("speech %s: no capacity: %s", request[REQUEST_ID], chunk.error)
        raise capacity_error()
    if chunk.error:
        log.error("speech %s failed: %s", request[REQUEST_ID], chunk.error)
        raise ApiError(500, "synthesis_failed", f"synthesis failed (request id {request[REQUEST_ID]})")


async def _whole_file(request: web.Request, stream: ChunkStream, fmt: str,
                      sample_rate: int | None) -> web.StreamResponse:
    # Encoded as it arrives into a spool (memory up to a threshold, then a temp file): a long
    # signal is never held whole. Encoding runs in a thread: it must not block the loop.
    spool = AudioSpool(fmt, request.app[STATE_KEY].settings.whole_file_memory_bytes, sample_rate)
    truncated: list[str] = []  # why utterances were ended early, in order (a header says so)
    try:
        while True:
            chunk = await stream.next_chunk()
            if chunk.pcm.size:
                await asyncio.to_thread(spool.write, chunk.pcm)
            if chunk.truncated:
                truncated.append(chunk.truncated)
            if chunk.is_final:
                break
            if client_gone(request):
                stream.cancel()
                raise ApiError(499, "client_closed", "the client went away")
        _raise_failure(request, chunk)
        size = await asyncio.to_thread(spool.finish)
        headers = {"Content-Type": CONTENT_TYPES[fmt], "Content-Length": str(size),
                   **request.app[STATE_KEY].audio_headers()}
        if truncated:  # utterances the talker ended early (a runaway): their reasons, in order
            headers[TRUNCATED_HEADER] = ",".join(truncated)
        response = web.StreamResponse(headers=headers)
        try:
            await response.prepare(request)
            while block := await asyncio.to_thread(spool.read):
                await response.write(block)
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            log.info("speech %s: client went away", request[REQUEST_ID])
            request.app[STATE_KEY].metrics.count("/v1/audio/speech", "client_closed")
            request[COUNTED] = True
        return response
    finally:
        spool.close()  # quick: frees memory or unlinks a temp file


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


async def _streamed(request: web.Request, work: _SpeechWork, fmt: str, stream_format: str,
                    body: SpeechBody) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    stream = work.stream
    sse = stream_format == "sse"
    # The status is sent with the first audio: a request that fails before any audio gets
    # its HTTP error (500 / 503) like a whole-file request, not a 200 with nothing in it.
    chunk = await stream.next_chunk()
    if chunk.is_final and not chunk.pcm.size:
        _raise_failure(request, chunk)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream" if sse else CONTENT_TYPES[fmt],
                                           "Cache-Control": "no-cache", **state.audio_headers()})
    encoder = StreamEncoder(fmt, body.sample_rate)
    samples = 0

    async def send(data: bytes) -> None:
        if not data:
            return
        await response.write(_sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                             if sse else data)

    try:
        await response.prepare(request)
        await send(encoder.header())
        while True:
            if sse and stream.last_gap:  # (raw audio cannot carry it: /metrics counts it for every stream)
                await response.write(_sse(behind_event(stream.last_gap, stream.clock.behind_s)))
            samples += chunk.pcm.size
            await send(await encoder.encode_async(chunk.pcm))  # mp3 / opus / aac off the loop
            if sse and chunk.truncated and not chunk.error:  # (raw audio: /metrics counts it)
                await response.write(_sse(truncated_event(chunk.truncated)))
            if chunk.is_final:
                break
            chunk = await stream.next_chunk()
        if chunk.error and sse:
            code = work.abort_code or ("cancelled" if chunk.error == "cancelled" else
                                       "overloaded" if is_capacity_error(chunk.error) else "synthesis_failed")
            await response.write(_sse({"type": "error", "error": {"code": code, "message": chunk.error}}))
        elif not chunk.error:
            await send(await encoder.finish_async())
            if sse and chunk.alignment is not None:
                await response.write(_sse({"type": "speech.audio.alignment", "text": chunk.alignment.text,
                                           "language": chunk.alignment.language,
                                           "words": words_json(chunk.alignment)}))
            if sse:
                done = {"type": "speech.audio.done", "usage": usage(body.input, samples, state.engine.info.sample_rate)}
                if stream.clock.underruns:
                    done["behind_s"] = round(stream.clock.behind_s, 3)
                await response.write(_sse(done))
        await response.write_eof()
    except (ConnectionResetError, ConnectionError):
        log.info("speech %s: client went away", request[REQUEST_ID])
        state.metrics.count("/v1/audio/speech", "client_closed")
        request[COUNTED] = True
    return response


def usage(text: str, samples: int, sample_rate: int) -> dict:
    """SSE ``speech.audio.done`` usage with OpenAI's names: input tokens = the input's
    characters, output tokens = the codec frames of the audio (12.5 per second); our own
    older names stay beside them."""
    frames = -(-samples // SAMPLES_PER_FRAME)
    return {"input_tokens": len(text), "output_tokens": frames, "total_tokens": len(text) + frames,
            "input_characters": len(text), "output_samples": samples,
            "audio_seconds": round(samples / sample_rate, 3)}
