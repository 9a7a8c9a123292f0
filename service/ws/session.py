"""WebSocket ``/v1/stream``: text in as it is typed, PCM16 out as it is generated.

A session has two tasks. The reader parses client messages, splits the text buffer
into sentences and appends work items (utterances and end-of-round markers) to a
queue. The speaker takes the items in order, submits each utterance (the next one is
submitted early so audio has no gap) and sends ``audio.start``, binary frames and
``audio.done``; utterances never interleave. The protocol is specified in docs/API.md.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import uuid
from dataclasses import dataclass

import numpy as np
from aiohttp import WSCloseCode, web

from engines.contract import Priority, VoiceClone
from engines.models.text import SentenceSplitter
from service.access.auth import WS_SUBPROTOCOL, websocket_key
from service.access.limits import client_identity
from service.errors import RETRY_LATER, ApiError, StoreUnavailable, is_capacity_error
from service.state import COUNTED, REQUEST_ID, STATE_KEY, AppState
from service.synthesis.audio import to_pcm16
from service.synthesis.chunks import ChunkStream, PlaybackClock, behind_event, truncated_event
from service.synthesis.params import SynthesisParams, parse, update_params
from service.synthesis.plan import BreakTags, Pause, break_tag, check_work
from service.synthesis.schema import CloneFields, InputText, LiveTextConfig, too_long
from service.synthesis.submit import open_stream, prepare
from service.synthesis.timestamps import TimestampsField, words_json
from service.voices.clones import clone_for, saved_clone
from service.ws.live_input import LiveInput, LiveUtterance
from service.ws.reader import MessageReader

log = logging.getLogger("streamvox.ws")

PROTOCOL_VERSION = 1
FADE_OUT_SAMPLES = 480  # 20 ms ramp to silence when an utterance is cancelled
CLOSE_OVERLOADED = 1013  # "try again later"
# Back-pressure must reach the engine quickly: cap what the kernel and the transport
# may hold for one slow reader (64 KiB is over a second of PCM16 at 24 kHz, plenty of
# window for real-time audio on any link).
SOCKET_SEND_BUFFER = 64 * 1024
TRANSPORT_BUFFER_LIMIT = 64 * 1024
ENDPOINT = "/v1/stream"
SEND_ERROR_TIMEOUT_S = 2.0  # a fatal error to a client that does not read: give up and drop the socket


class SessionClosed(Exception):
    """The socket is gone or a fatal error was sent; stop the session."""


async def wait_for_reader(request: web.Request) -> None:
    """Back-pressure: return once the socket's write buffer is below ``TRANSPORT_BUFFER_LIMIT``
    (the client reads again); SessionClosed when the connection is going away."""
    transport = request.transport
    while transport is not None and not transport.is_closing() \
            and transport.get_write_buffer_size() > TRANSPORT_BUFFER_LIMIT:
        await asyncio.sleep(0.02)
    if transport is None or transport.is_closing():
        raise SessionClosed()


async def close_socket(request: web.Request, ws: web.WebSocketResponse, close_code: int, reason: bytes) -> None:
    """Close ``ws``; a client that does not answer the close within ``SEND_ERROR_TIMEOUT_S``
    must not hold it open: its connection is dropped."""
    try:
        await asyncio.wait_for(ws.close(code=close_code, message=reason), SEND_ERROR_TIMEOUT_S)
    except asyncio.TimeoutError:
        if request.transport is not None:
            request.transport.close()


@dataclass
class Utterance:
    text: str
    refused: bool = False  # over the work limit: the error was sent once, it is skipped
    live: LiveUtterance | None = None  # text still arriving (service/ws/live_input.py)


@dataclass
class EndOfRound:
    """Marks where an ``input.done`` (or a cancel) ends a round: send ``session.done``."""


class StreamSession(MessageReader):
    def __init__(self, request: web.Request, ws: web.WebSocketResponse, state: AppState):
        self.request = request
        self.ws = ws
        self.state = state
        self.session_id = uuid.uuid4().hex
        self.params = SynthesisParams()
        self.sentences = SentenceSplitter()  # text not yet ending in a sentence boundary, read once
        self.queue: collections.deque[Utterance | EndOfRound] = collections.deque()
        # O(1) accounting, kept in step with the queue (never recomputed by walking it):
        self.queued_text = 0  # characters of the queued utterances
        self.queued_rounds = 0  # EndOfRound markers in the queue
        self.cancelled_rounds = 0  # rounds ended by a cancel, answered before anything queued
        self.wake = asyncio.Event()
        self.next_utterance = 0
        self.round_utterances = 0
        self.submitted = 0
        self.current: ChunkStream | None = None
        self.prefetched: tuple[Utterance, ChunkStream] | None = None
        self.cancelling = False
        self.closed = False
        self.outcome = "ok"  # or the fatal error code that ended the session
        # --- live text: on a talker checkpoint deltas feed a live utterance at once
        self.text_streaming: bool | None = None  # session.config; None = on for talker checkpoints
        self.live = LiveInput(state.settings.ws_live_utterance_chars)
        self.breaks = BreakTags()  # live text: a break tag cut between deltas waits for its end
        self.clone: VoiceClone | None = None  # the saved voice session.config named
        # When the listener finishes playing the audio sent so far (loop time; None: nothing
        # playing): the next utterance's playback clock starts there, so audio prefetched
        # while this one speaks is not taken for audio that came late.
        self.plays_until: float | None = None
        self.timestamps = False  # session.config "timestamps": alignment messages after each utterance's audio
        self.samples_sent = 0  # the session's audio so far: its clock, which alignment times are on
        # streams counted against the key's engine requests (limits.py): whether each was started
        # (waited for its turn) or prefetched
        self.counted: dict[ChunkStream, bool] = {}
        self.awaiting_turn = False  # the next utterance waits for its key's turn (limits.py)
        self.cancels = 0  # response.cancel (or the end) so far: an utterance that waited for a turn checks it

    @property
    def identity(self) -> str:
        """Who this session works for, for the per-key limits (the key checked at the handshake)."""
        return client_identity(self.request, self.state.api_keys, websocket=True)

    @property
    def live_mode(self) -> bool:
        if self.clone is not None and self.clone.in_context:
            return False  # an in-context clone's prompt interleaves the reference with the whole text
        if self.text_streaming is not None:
            return self.text_streaming
        return self.state.engine.capabilities.live_text

    # -- state the drain and the reader look at ------------------------------------
    @property
    def busy(self) -> bool:
        """Audio is queued or being produced (text still waiting for a sentence end is not work yet)."""
        return bool(self.queue) or self.cancelled_rounds > 0 or self.current is not None or self.awaiting_turn

    def queued_chars(self) -> int:
        return len(self.sentences.rest) + self.queued_text

    @property
    def pending_rounds(self) -> int:
        """Rounds (input.done / response.cancel) not answered by session.done yet."""
        return self.queued_rounds + self.cancelled_rounds

    # -- sending -------------------------------------------------------------------
    async def send_json(self, message: dict) -> None:
        if self.closed or self.ws.closed:
            raise SessionClosed()
        try:
            await self.ws.send_json(message)
        except (ConnectionError, RuntimeError) as exc:
            raise SessionClosed() from exc

    async def send_pcm(self, pcm: np.ndarray) -> int:
        await self.send_bytes(to_pcm16(pcm))
        return int(pcm.size)

    async def send_bytes(self, data: bytes) -> None:
        if self.closed or self.ws.closed:
            raise SessionClosed()
        try:
            await self.ws.send_bytes(data)
            await self.wait_for_reader()
        except (ConnectionError, RuntimeError) as exc:
            raise SessionClosed() from exc

    async def wait_for_reader(self) -> None:
        """Hold the speaker while the client is behind; its chunk buffer then fills and pauses the engine."""
        await wait_for_reader(self.request)

    async def error(self, code: str, message: str) -> None:
        await self.send_json({"type": "error", "code": code, "message": message})

    async def fatal(self, code: str, message: str, close_code: int) -> None:
        if self.closed:
            return
        self.outcome = code
        self.closed = True
        self.cancel_all()
        try:  # a client that does not read must not hold the session open: bounded waits
            if not self.ws.closed:
                await asyncio.wait_for(self.ws.send_json({"type": "error", "code": code, "message": message}),
                                       SEND_ERROR_TIMEOUT_S)
        except (ConnectionError, RuntimeError, asyncio.TimeoutError):
            pass
        await close_socket(self.request, self.ws, close_code, code.encode())

    async def abort(self, code: str, message: str) -> None:
        """Called by the drain when the grace period is over."""
        await self.fatal(code, message, WSCloseCode.GOING_AWAY)

    # -- the reader (service/ws/reader.py) ---------------------------------------------
    LONE_SURROGATE = "contains a lone surrogate (not valid Unicode text)"

    def read_timeout(self, first: bool) -> tuple[float, str]:
        settings = self.state.settings
        if first:
            return settings.ws_config_timeout_s, "config_timeout"
        return settings.ws_idle_timeout_s, "idle_timeout"

    async def quiet(self, timeout: float) -> bool:
        if self.live.open is not None:  # live text stopped without input.done: end it cleanly
            self.live.finish()
            await self.error("input_idle", f"no text for {timeout:g} s: the live utterance was ended "
                                           "(its audio follows); send input.done to end one yourself")
            return True
        return self.busy

    def unusable_value(self, message: dict) -> str:
        return f"{message.get('type')}: a field has a value that cannot be used"

    async def on_message(self, message: dict) -> None:
        kind = message.get("type")
        handler = {
            "session.config": self.on_config,
            "input.text": self.on_input_text,
            "input.done": self.on_input_done,
            "response.cancel": self.on_cancel,
            "session.close": self.on_close,
        }.get(kind if isinstance(kind, str) else "")
        if handler is None:
            await self.error("unknown_type", f"unknown message type {str(kind)[:64]!r}")
            return
        await handler(message)

    async def on_config(self, message: dict) -> None:
        try:
            streaming = parse(LiveTextConfig, message).text_streaming  # checked first: all or nothing
            timestamps = parse(TimestampsField, message).timestamps
            live = streaming if streaming is not None else self.live_mode
            params = update_params(self.params, message, self.state.engine, live_text=live)
            clone = await self.voice_after(message, params)
        except ApiError as exc:
            await self.error(exc.code, exc.message)
            return
        except StoreUnavailable:
            await self.error("database_unavailable", "voice: saved voices are unreachable now (the database is "
                                                     "down); retry, or use a built-in voice")
            return
        self.params, self.clone = params, clone
        if timestamps is not None:
            self.timestamps = timestamps
        if streaming is not None and streaming != self.live_mode:
            self.live.finish()  # the open live utterance (if any) ends where the mode changes
            self.text_streaming = streaming
        self.drop_prefetch()  # it was submitted with the old parameters

    async def voice_after(self, message: dict, params: SynthesisParams) -> VoiceClone | None:
        """The voice prompt after this ``session.config``: inline ``ref_audio`` (+ ``ref_text``,
        ``x_vector_only_mode``) as on HTTP speech, else the saved voice a new ``voice`` names;
        a config naming neither keeps the session's. Looked up here, once, not per utterance."""
        if any(message.get(name) is not None for name in CloneFields.model_fields):
            return await clone_for(self.request, params.voice, parse(CloneFields, message))
        if message.get("voice") is not None:
            return await saved_clone(self.request, params.voice)
        return self.clone

    async def on_input_text(self, message: dict) -> None:
        try:
            text = parse(InputText, message).text
        except ApiError as exc:
            await self.error(exc.code, exc.message)
            return
        limit = self.state.settings.max_input_chars
        open_live = len(self.live.open.text) + len(self.live.open.held) if self.live.open is not None else 0
        waiting = self.queued_chars() + open_live
        if waiting + len(text) > limit:
            await self.error("text_too_long", too_long("text", waiting + len(text), limit)
                             + ("; wait for audio.done before sending more" if waiting else ""))
            return
        if self.live_mode:
            self.add_live(self.breaks.feed(text))
            return
        self.enqueue(Utterance(s) for s in self.sentences.feed(text))  # reads only the new text

    def add_live(self, pieces) -> None:
        """Live text: text feeds the open live utterance (opening one when none is); a break tag
        ends it and is spoken as its own utterance, a pause (service/synthesis/plan.py)."""
        for piece in pieces:
            if isinstance(piece, Pause):
                self.live.finish()
                self.enqueue([Utterance(break_tag(piece))])
            else:
                opened, _ended = self.live.add(piece)
                self.enqueue(Utterance("", live=u) for u in opened)

    async def over_rounds_bound(self) -> bool:
        """A client that ends rounds faster than it reads their session.done is closed."""
        limit = self.state.settings.ws_max_pending_rounds
        if self.pending_rounds < limit:
            return False
        await self.fatal("too_many_rounds",
                         f"more than {limit} rounds (input.done / response.cancel) wait for session.done; "
                         "read the replies before ending more rounds", WSCloseCode.POLICY_VIOLATION)
        return True

    async def on_input_done(self, message: dict) -> None:
        if await self.over_rounds_bound():
            return
        self.add_live([self.breaks.take_rest()])  # the start of a tag that never ended was text
        self.live.finish()
        rest = self.sentences.take_rest().strip()
        items: list[Utterance | EndOfRound] = [Utterance(rest)] if rest else []
        self.enqueue(items + [EndOfRound()])

    async def on_cancel(self, message: dict) -> None:
        # Queued utterances are dropped; their rounds' end markers become cancelled_rounds
        # (a counter, answered first), so every input.done and every response.cancel is
        # answered by exactly one session.done. No walk over the queue.
        if await self.over_rounds_bound():
            return
        self.sentences.take_rest()
        self.breaks.take_rest()
        self.live.finish()
        self.cancels += 1
        self.cancelled_rounds += self.queued_rounds + 1
        self.clear_queue()
        self.drop_prefetch()
        if self.current is not None:
            self.cancelling = True
            self.current.cancel()
        self.wake.set()

    async def on_close(self, message: dict) -> None:
        self.closed = True
        self.cancel_all()
        await self.ws.close(code=WSCloseCode.OK)

    def enqueue(self, items) -> None:
        for item in items:
            if isinstance(item, Utterance):
                self.queued_text += len(item.text)
            else:
                self.queued_rounds += 1
            self.queue.append(item)
        self.wake.set()

    def dequeue(self) -> Utterance | EndOfRound:
        item = self.queue.popleft()
        if isinstance(item, Utterance):
            self.queued_text -= len(item.text)
        else:
            self.queued_rounds -= 1
        return item

    def clear_queue(self) -> None:
        self.queue.clear()
        self.queued_text = 0
        self.queued_rounds = 0

    # -- the speaker ---------------------------------------------------------------
    async def speak_loop(self) -> None:
        while not self.closed:
            while not self.queue and not self.cancelled_rounds:
                self.wake.clear()
                await self.wake.wait()
            if self.cancelled_rounds:  # rounds ended by a cancel precede everything queued now
                self.cancelled_rounds -= 1
                item: Utterance | EndOfRound = EndOfRound()
            else:
                item = self.dequeue()
            if isinstance(item, EndOfRound):
                await self.send_json({"type": "session.done", "utterances": self.round_utterances})
                self.round_utterances = 0
                continue
            stream = self.take_prefetched(item) or await self.submit(item)
            if stream is not None:
                await self.speak(item, stream)

    async def submit(self, utterance: Utterance, wait: bool = True) -> ChunkStream | None:
        """Submit one utterance; a fatal error closes the session, a bad field skips it, and
        so does an utterance over the work limit (an ``error`` before any engine time). The
        request counts against the key's engine requests (every socket, every context):
        ``wait`` for the key's turn, or (a prefetch) submit nothing when it has none now."""
        if utterance.refused:
            return None
        try:
            parts = check_work(self.state.engine, utterance.text, self.params, self.state.settings)
        except ApiError as exc:
            utterance.refused = True
            await self.error(exc.code, exc.message)
            return None
        limits, identity = self.state.limits, self.identity
        if wait:
            cancels = self.cancels
            self.awaiting_turn = True
            try:
                await limits.open_request(identity)
            finally:
                self.awaiting_turn = False
            if self.closed or self.cancels != cancels:  # cancelled while it waited: it is not spoken
                limits.close_request(identity, started=True)
                return None
        elif not limits.open_prefetch(identity):
            return None
        self.submitted += 1
        request_id = f"{self.session_id}-{self.submitted}"  # ids for logs; no text is logged
        try:
            prepared = prepare(self.state.engine, request_id, parts, self.params, Priority.REALTIME,
                               clone=self.clone,  # a saved voice, looked up at session.config
                               tenant=identity,
                               text_feed=utterance.live.feed if utterance.live is not None else None,
                               timestamps=self.timestamps)
            stream = open_stream(self.state, prepared, high_water=self.state.settings.ws_buffer_chunks)
        except ApiError as exc:
            limits.close_request(identity, started=wait)
            if exc.status == 429:
                await self.fatal(exc.code, "the server is at capacity; reconnect later", CLOSE_OVERLOADED)
                raise SessionClosed() from None
            if exc.status in RETRY_LATER:
                await self.fatal(exc.code, exc.message, WSCloseCode.TRY_AGAIN_LATER)
                raise SessionClosed() from None
            await self.error(exc.code, exc.message)
            return None
        except BaseException:
            limits.close_request(identity, started=wait)
            raise
        self.counted[stream] = wait
        return stream

    def end_stream(self, stream: ChunkStream) -> None:
        """The session is done with ``stream`` (spoken, dropped or cancelled): it stops, and no
        longer counts against the key's engine requests."""
        stream.cancel()
        if stream in self.counted:
            self.state.limits.close_request(self.identity, started=self.counted.pop(stream))

    def take_prefetched(self, utterance: Utterance) -> ChunkStream | None:
        if self.prefetched is not None and self.prefetched[0] is utterance:
            stream = self.prefetched[1]
            self.prefetched = None
            return stream
        self.drop_prefetch()
        return None

    def drop_prefetch(self) -> None:
        if self.prefetched is not None:
            self.end_stream(self.prefetched[1])
            self.prefetched = None

    async def prefetch_next(self) -> None:
        """Submit the next queued utterance now so its audio is ready when this one ends."""
        if self.prefetched is None and self.queue and isinstance(self.queue[0], Utterance):
            upcoming = self.queue[0]
            stream = await self.submit(upcoming, wait=False)  # never hold this utterance's audio for a turn
            if stream is not None:
                self.prefetched = (upcoming, stream)

    async def speak(self, utterance: Utterance, stream: ChunkStream) -> None:
        index = self.next_utterance
        self.next_utterance += 1
        self.round_utterances += 1
        self.current = stream
        self.cancelling = False
        samples = 0
        starts_at = self.samples_sent  # where this utterance starts on the session's clock
        last_sample = 0.0
        truncated: str | None = None
        stream.clock = PlaybackClock(self.state.engine.info.sample_rate, starts_at=self.plays_until)
        if utterance.live is not None:  # silence while its text still arrives is the client's, not ours
            stream.count_gaps = lambda feed=utterance.live.feed: feed.finished
        try:
            start = {"type": "audio.start", "utterance": index, "text": utterance.text}
            if utterance.live is not None:  # its text is still arriving: audio.done says what it was
                start.update(live=True, text_start=utterance.live.text_start)
            await self.send_json(start)
            while True:
                chunk = await stream.next_chunk()
                if chunk.pcm.size and not self.cancelling and not chunk.error:
                    if stream.last_gap:
                        await self.send_json(behind_event(stream, utterance=index))
                    sent = await self.send_pcm(chunk.pcm)
                    samples += sent
                    self.samples_sent += sent
                    last_sample = float(chunk.pcm[-1])
                if chunk.truncated and not self.cancelling and not chunk.error:  # the talker ended a runaway
                    truncated = chunk.truncated
                    await self.send_json(truncated_event(truncated, utterance=index))
                if chunk.is_final:
                    break
                # Start the next utterance once this one is audible (not before: it would
                # share this one's first ticks and delay its first audio), and again after
                # every chunk, so text that arrives later is ready in time too.
                await self.prefetch_next()
            if chunk.alignment is not None and not self.cancelling and not chunk.error:
                await self.send_alignment(index, chunk.alignment,
                                          starts_at * 1000.0 / self.state.engine.info.sample_rate)
            done = {"type": "audio.done", "utterance": index, "samples": samples}
            if self.cancelling or chunk.error == "cancelled":
                # A ramp from the last sample sent to silence, so the cut does not click.
                fade = await self.send_pcm(np.linspace(last_sample, 0.0, FADE_OUT_SAMPLES, dtype=np.float32))
                samples += fade
                self.samples_sent += fade
                done.update(samples=samples, cancelled=True)
            elif is_capacity_error(chunk.error):  # no room now, not a fault: the client may send it again
                log.warning("session %s utterance %d: no capacity: %s", self.session_id, index, chunk.error)
                done["error"] = "overloaded"
            elif chunk.error:
                log.error("session %s utterance %d failed: %s", self.session_id, index, chunk.error)
                done["error"] = "synthesis_failed"
            done["duration_s"] = round(samples / self.state.engine.info.sample_rate, 4)
            if truncated:
                done["truncated"] = truncated
            if stream.clock.underruns:
                done.update(behind_s=round(stream.clock.behind_s, 3), underruns=stream.clock.underruns)
            cancelled = done.get("cancelled", False)
            self.plays_until = None if cancelled else stream.clock.runs_dry_at
            if utterance.live is not None:
                u = utterance.live
                done.update(text=u.text, text_start=u.text_start, text_end=u.text_start + len(u.text))
            await self.send_json(done)
        finally:
            self.end_stream(stream)
            self.current = None
            self.cancelling = False

    async def send_alignment(self, index: int, alignment, offset_ms: float) -> None:
        """``alignment``: the word times of an utterance, on the session's clock (after its audio)."""
        await self.send_json({"type": "alignment", "utterance": index, "text": alignment.text,
                              "language": alignment.language, "offset_ms": round(offset_ms, 1),
                              "duration_ms": round(alignment.duration_ms, 1),
                              "words": words_json(alignment, offset_ms)})

    def cancel_all(self) -> None:
        self.cancels += 1
        self.live.finish()
        self.clear_queue()
        self.cancelled_rounds = 0
        self.drop_prefetch()
        if self.current is not None:
            self.current.cancel()


async def stream_session(request: web.Request, session_type: type[StreamSession] = StreamSession,
                         endpoint: str = ENDPOINT) -> web.WebSocketResponse:
    """A session of ``session_type`` (a dialect of the protocol: service/ws/omni.py)."""
    state = request.app[STATE_KEY]
    state.check_admission()
    ws = web.WebSocketResponse(protocols=(WS_SUBPROTOCOL,), max_msg_size=state.settings.max_ws_message_bytes,
                               heartbeat=30.0)
    ws.headers.update(state.audio_headers())  # in the handshake too: vllm-omni's dialect has no session.created
    await ws.prepare(request)
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER)
    session = session_type(request, ws, state)
    if not state.api_keys.accepts(websocket_key(request)):
        state.metrics.count(endpoint, "unauthorized")
        request[COUNTED] = True
        await session.fatal("unauthorized", "missing or invalid API key", WSCloseCode.POLICY_VIOLATION)
        return ws
    identity = client_identity(request, state.api_keys, websocket=True)
    try:
        state.limits.check_rate(identity)
    except ApiError as exc:
        state.metrics.count(endpoint, exc.code)
        request[COUNTED] = True
        await session.fatal(exc.code, exc.message, CLOSE_OVERLOADED)
        return ws
    if not state.limits.open_session(identity):
        state.metrics.count(endpoint, "too_many_sessions")
        request[COUNTED] = True
        limit = state.settings.max_sessions_per_key
        await session.fatal("too_many_sessions", f"at most {limit} concurrent sessions per key",
                            WSCloseCode.POLICY_VIOLATION)
        return ws
    log.info("session %s opened (request %s)", session.session_id, request[REQUEST_ID])
    state.streams.add(session)
    speaker = asyncio.create_task(session.speak_loop())
    reader = asyncio.create_task(session.read_loop())
    try:
        await session.send_json({"type": "session.created", "session_id": session.session_id,
                                 "protocol": PROTOCOL_VERSION, "sample_rate": state.engine.info.sample_rate,
                                 "format": "pcm_s16le", "channels": 1,
                                 # as the speech header X-Streamvox-Random-Weights: noise, not speech
                                 "random_components": list(state.engine.info.random_components)})
        await asyncio.wait({speaker, reader}, return_when=asyncio.FIRST_COMPLETED)
        for task in (speaker, reader):
            if task.done() and not task.cancelled() and task.exception() is not None:
                if not isinstance(task.exception(), SessionClosed):
                    log.error("session %s failed", session.session_id, exc_info=task.exception())
    except SessionClosed:
        pass  # the client left before session.created
    finally:
        state.limits.close_session(identity)
        state.streams.discard(session)
        session.closed = True
        session.cancel_all()
        for task in (speaker, reader):
            task.cancel()
        await asyncio.gather(speaker, reader, return_exceptions=True)
        if not ws.closed:
            await ws.close()
        state.metrics.count(endpoint, session.outcome)
        request[COUNTED] = True
        log.info("session %s closed (%s)", session.session_id, session.outcome)
    return ws
