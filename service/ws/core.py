"""The session core every socket stands on: text in, utterances spoken in order, typed events out.

A :class:`SessionCore` holds a session's settings (parameters, voice, live text, timestamps), its
:class:`~service.ws.utterances.UtteranceQueue` and the speaker: :meth:`SessionCore.speak_loop`
takes the queue's items in order, submits each utterance (the next one early, so audio has no
gap), and reports what happens to its :class:`~service.ws.events.SessionSink`. Utterances never
interleave. The socket that owns it parses its protocol's messages and calls the core's methods:
:meth:`configure`, :meth:`add_text`, :meth:`end_round`, :meth:`cancel`, :meth:`stop`.

    core = SessionCore(request, state, sink, session_id)
    await core.configure({"voice": "ryan"})
    await core.add_text("Hello there. ")
    await core.end_round()           # the sink gets the utterance's events, then RoundDone
    await core.speak_loop()          # (a task of the socket's)
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np
from aiohttp import WSCloseCode, web

from engines.contract import Priority, VoiceClone
from service.access.limits import client_identity
from service.errors import RETRY_LATER, ApiError, StoreUnavailable, is_capacity_error
from service.state import AppState
from service.synthesis.chunks import ChunkStream, PlaybackClock
from service.synthesis.params import SynthesisParams, check_params, update_params
from service.synthesis.plan import check_work
from service.synthesis.schema import CloneFields, too_long
from service.synthesis.submit import open_stream
from service.voices.clones import Voice, voice_for
from service.synthesis.events import AlignmentReady, Audio, StreamBehind, UtteranceTruncated
from service.ws.events import (
    CLOSE_OVERLOADED,
    RoundDone,
    SessionClosed,
    SessionError,
    SessionSink,
    UtteranceDone,
    UtteranceStarted,
)
from service.ws.utterances import EndOfRound, Utterance, UtteranceQueue

log = logging.getLogger("streamvox.ws")

FADE_OUT_SAMPLES = 480  # 20 ms ramp to silence when an utterance is cancelled


class SessionCore:
    def __init__(self, request: web.Request, state: AppState, sink: SessionSink, session_id: str,
                 text_streaming: bool | None = None):
        self.request = request
        self.state = state
        self.sink = sink
        self.session_id = session_id  # engine request ids are "<session_id>-<n>": no client text
        self.params = SynthesisParams()
        self.clone: VoiceClone | None = None  # inline ref_audio or a saved voice, looked up once
        self.text_streaming = text_streaming  # None: live text on checkpoints that take it
        self.timestamps = False  # word times (AlignmentReady) after each utterance's audio
        self._queue = UtteranceQueue(state.settings.ws_live_utterance_chars)
        self.closed = False
        self.outcome = "ok"  # or the fatal error code that ended the session
        self.current: ChunkStream | None = None
        self.cancelling = False  # the utterance being spoken is being cancelled: its audio stops
        self.prefetched: tuple[Utterance, ChunkStream] | None = None
        self._next_utterance = 0
        self._round_utterances = 0
        self._submitted = 0
        # When the listener finishes playing the audio sent so far (loop time; None: nothing
        # playing): the next utterance's playback clock starts there, so audio prefetched
        # while this one speaks is not taken for audio that came late.
        self._plays_until: float | None = None
        self._samples_sent = 0  # the session's audio so far: its clock, which alignment times are on
        # streams counted against the key's engine requests (limits.py): started (waited for
        # the key's turn) or prefetched
        self._counted: dict[ChunkStream, bool] = {}
        self._awaiting_turn = False  # the next utterance waits for its key's turn (limits.py)
        self._cancels = 0  # cancels so far: an utterance that waited for a turn checks it

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

    @property
    def busy(self) -> bool:
        """Audio is queued or being produced (text still waiting for a sentence end is not work yet)."""
        return self._queue.has_work or self.current is not None or self._awaiting_turn

    @property
    def can_end_round(self) -> bool:
        """False while more rounds wait for their end than the server holds (a client that ends
        rounds faster than it reads their answers)."""
        return self._queue.pending_rounds < self.state.settings.ws_max_pending_rounds

    # -- what the socket calls -----------------------------------------------------------
    async def configure(self, changes: Mapping[str, Any], *, clone: CloneFields | None = None,
                        voice: Voice | None = None, text_streaming: bool | None = None,
                        timestamps: bool | None = None) -> None:
        """Apply a configuration, all of it or none (a SessionError says why not).
        ``changes``: the SynthesisParams fields to change (:meth:`SynthesisParams.update`);
        ``clone``: inline reference audio; else a new ``voice`` may name a saved voice (resolved
        here, once: service/voices/clones.py ``voice_for``; ``voice``: resolved by the socket
        already); else the session's voice prompt stays. Each None: unchanged."""
        try:
            live = text_streaming if text_streaming is not None else self.live_mode
            params = update_params(self.params, changes)
            if voice is None and (clone is not None or changes.get("voice") is not None):
                voice = await voice_for(self.request, params.voice, clone)
            if voice is not None:
                params = params.model_copy(update={"voice": voice.name})
            voice_clone = voice.clone if voice is not None else self.clone
            params = check_params(self.state.engine, params, clone=voice_clone, live_text=live)
        except ApiError as exc:
            await self.sink.session_error(SessionError(exc.code, exc.message))
            return
        except StoreUnavailable:
            await self.sink.session_error(SessionError(
                "database_unavailable", "voice: saved voices are unreachable now (the database is down); retry, "
                                        "or use a built-in voice"))
            return
        self.params, self.clone = params, voice_clone
        if timestamps is not None:
            self.timestamps = timestamps
        if text_streaming is not None and text_streaming != self.live_mode:
            self._queue.finish_live()  # the open live utterance (if any) ends where the mode changes
            self.text_streaming = text_streaming
        self._drop_prefetch()  # it was submitted with the old parameters

    async def add_text(self, text: str) -> None:
        """More text: sentences (or live text) queue for the speaker; too much waiting is an error."""
        limit = self.state.settings.max_input_chars
        waiting = self._queue.waiting_chars()
        if waiting + len(text) > limit:
            await self.sink.session_error(SessionError(
                "text_too_long", too_long("text", waiting + len(text), limit)
                + ("; wait for audio.done before sending more" if waiting else "")))
            return
        try:
            self._queue.add(text, live=self.live_mode)
        except ApiError as exc:  # a malformed break tag in live text: this text is refused
            await self.sink.session_error(SessionError(exc.code, exc.message))

    async def end_round(self) -> None:
        """Speak what is buffered; RoundDone follows its audio."""
        if await self._over_rounds_bound():
            return
        try:
            self._queue.end_round()
        except ApiError as exc:  # the live text ended inside a break tag: the round still ends
            await self.sink.session_error(SessionError(exc.code, exc.message))

    async def cancel(self) -> None:
        """Drop queued text and stop the utterance being spoken within one chunk; RoundDone
        follows (after the rounds still pending, each answered in order)."""
        if await self._over_rounds_bound():
            return
        self._cancels += 1
        self._queue.cancel()
        self._drop_prefetch()
        if self.current is not None:
            self.cancelling = True
            self.current.cancel()

    def end_live_text(self) -> bool:
        """The client went quiet: the open live utterance ends (its audio follows). False: none was open."""
        return self._queue.finish_live()

    def stop(self) -> None:
        """The session is over: nothing more is spoken, its engine requests are cancelled."""
        self.closed = True
        self._cancels += 1
        self._queue.drop()
        self._drop_prefetch()
        if self.current is not None:
            self.current.cancel()

    async def fail(self, code: str, message: str, close_code: int) -> None:
        """A fatal error: the session stops and its sink says so (once)."""
        if self.closed:
            return
        self.outcome = code
        self.stop()
        await self.sink.session_failed(SessionError(code, message, close_code))

    async def _over_rounds_bound(self) -> bool:
        """A client that ends rounds faster than it reads their answers is closed."""
        if self.can_end_round:
            return False
        limit = self.state.settings.ws_max_pending_rounds
        await self.fail("too_many_rounds", f"more than {limit} rounds (input.done / response.cancel) wait for "
                                           "session.done; read the replies before ending more rounds",
                        WSCloseCode.POLICY_VIOLATION)
        return True

    # -- the speaker ---------------------------------------------------------------------
    async def speak_loop(self) -> None:
        while not self.closed:
            item = await self._queue.next()
            if isinstance(item, EndOfRound):
                utterances, self._round_utterances = self._round_utterances, 0
                await self.sink.round_done(RoundDone(utterances))
                continue
            stream = self._take_prefetched(item) or await self._submit(item)
            if stream is not None:
                await self._speak(item, stream)

    async def _submit(self, utterance: Utterance, wait: bool = True) -> ChunkStream | None:
        """Submit one utterance; a fatal error closes the session, a bad field skips it, and
        so does an utterance over the work limit (an error before any engine time). The
        request counts against the key's engine requests (every socket, every context):
        ``wait`` for the key's turn, or (a prefetch) submit nothing when it has none now."""
        if utterance.refused:
            return None
        live = utterance.live.feed if utterance.live is not None else None
        try:
            plan = check_work(self.state.engine, utterance.text, self.params, self.state.settings, clone=self.clone,
                              text_feed=live)
        except ApiError as exc:
            utterance.refused = True
            await self.sink.session_error(SessionError(exc.code, exc.message))
            return None
        limits, identity = self.state.limits, self.identity
        if wait:
            cancels = self._cancels
            self._awaiting_turn = True
            try:
                await limits.open_request(identity)
            finally:
                self._awaiting_turn = False
            if self.closed or self._cancels != cancels:  # cancelled while it waited: it is not spoken
                limits.close_request(identity, started=True)
                return None
        elif not limits.open_prefetch(identity):
            return None
        self._submitted += 1
        request_id = f"{self.session_id}-{self._submitted}"  # ids for logs; no text is logged
        try:
            stream = open_stream(self.state, plan, request_id, Priority.REALTIME, tenant=identity,
                                 timestamps=self.timestamps, high_water=self.state.settings.ws_buffer_chunks)
        except ApiError as exc:
            limits.close_request(identity, started=wait)
            if exc.status == 429:
                await self.fail(exc.code, "the server is at capacity; reconnect later", CLOSE_OVERLOADED)
                raise SessionClosed() from None
            if exc.status in RETRY_LATER:
                await self.fail(exc.code, exc.message, WSCloseCode.TRY_AGAIN_LATER)
                raise SessionClosed() from None
            await self.sink.session_error(SessionError(exc.code, exc.message))
            return None
        except BaseException:
            limits.close_request(identity, started=wait)
            raise
        self._counted[stream] = wait
        return stream

    def _end_stream(self, stream: ChunkStream) -> None:
        """The session is done with ``stream`` (spoken, dropped or cancelled): it stops, and no
        longer counts against the key's engine requests."""
        stream.cancel()
        if stream in self._counted:
            self.state.limits.close_request(self.identity, started=self._counted.pop(stream))

    def _take_prefetched(self, utterance: Utterance) -> ChunkStream | None:
        if self.prefetched is not None and self.prefetched[0] is utterance:
            stream = self.prefetched[1]
            self.prefetched = None
            return stream
        self._drop_prefetch()
        return None

    def _drop_prefetch(self) -> None:
        if self.prefetched is not None:
            self._end_stream(self.prefetched[1])
            self.prefetched = None

    async def _prefetch_next(self) -> None:
        """Submit the next queued utterance now so its audio is ready when this one ends."""
        upcoming = self._queue.upcoming()
        if self.prefetched is None and upcoming is not None:
            stream = await self._submit(upcoming, wait=False)  # never hold this utterance's audio for a turn
            if stream is not None:
                self.prefetched = (upcoming, stream)

    async def _send_audio(self, index: int, pcm: np.ndarray) -> int:
        await self.sink.audio(Audio(index, pcm))
        self._samples_sent += int(pcm.size)
        return int(pcm.size)

    async def _speak(self, utterance: Utterance, stream: ChunkStream) -> None:
        index = self._next_utterance
        self._next_utterance += 1
        self._round_utterances += 1
        self.current = stream
        self.cancelling = False
        sample_rate = self.state.engine.info.sample_rate
        samples = 0
        starts_at = self._samples_sent  # where this utterance starts on the session's clock
        last_sample = 0.0
        truncated: str | None = None
        stream.clock = PlaybackClock(sample_rate, starts_at=self._plays_until)
        live = utterance.live
        if live is not None:  # silence while its text still arrives is the client's, not ours
            stream.count_gaps = lambda feed=live.feed: feed.finished
        try:
            await self.sink.utterance_started(UtteranceStarted(index, utterance.text, live))
            while True:
                chunk = await stream.next_chunk()
                if chunk.pcm.size and not self.cancelling and not chunk.error:
                    if stream.last_gap:
                        await self.sink.stream_behind(StreamBehind(index, stream.last_gap, stream.clock.behind_s))
                    samples += await self._send_audio(index, chunk.pcm)
                    last_sample = float(chunk.pcm[-1])
                if chunk.truncated and not self.cancelling and not chunk.error:  # the talker ended a runaway
                    truncated = chunk.truncated
                    await self.sink.utterance_truncated(UtteranceTruncated(index, truncated))
                if chunk.is_final:
                    break
                # Start the next utterance once this one is audible (not before: it would
                # share this one's first ticks and delay its first audio), and again after
                # every chunk, so text that arrives later is ready in time too.
                await self._prefetch_next()
            if chunk.alignment is not None and not self.cancelling and not chunk.error:
                await self.sink.alignment(AlignmentReady(index, chunk.alignment, starts_at * 1000.0 / sample_rate))
            cancelled = self.cancelling or chunk.error == "cancelled"
            error = None
            if cancelled:  # a ramp from the last sample sent to silence, so the cut does not click
                samples += await self._send_audio(index, np.linspace(last_sample, 0.0, FADE_OUT_SAMPLES,
                                                                     dtype=np.float32))
            elif is_capacity_error(chunk.error):  # no room now, not a fault: the client may send it again
                log.warning("session %s utterance %d: no capacity: %s", self.session_id, index, chunk.error)
                error = "overloaded"
            elif chunk.error:
                log.error("session %s utterance %d failed: %s", self.session_id, index, chunk.error)
                error = "synthesis_failed"
            self._plays_until = None if cancelled else stream.clock.runs_dry_at
            await self.sink.utterance_done(UtteranceDone(
                index, samples, round(samples / sample_rate, 4), cancelled=cancelled, error=error,
                truncated=truncated, behind_s=stream.clock.behind_s, underruns=stream.clock.underruns,
                live=live))
        finally:
            self._end_stream(stream)
            self.current = None
            self.cancelling = False


__all__ = ["SessionCore"]
