"""What the session core (service/ws/core.py) tells the socket it speaks for: typed events, in
the order they happen, to a :class:`SessionSink`.

Per utterance: :class:`UtteranceStarted`, the events of its speech (service/synthesis/events.py:
its audio, the listener running behind, a truncation, its word times), then
:class:`UtteranceDone`. A round (ended by the client, or by a cancel) ends with
:class:`RoundDone` after its utterances. :class:`SessionError` is an error the session survives;
:meth:`SessionSink.session_failed` one that ended it.

Each protocol is a sink that writes its own wire format: ``/v1/stream`` (service/ws/session.py),
vllm-omni's socket (service/ws/omni.py), a context of a voice-agent dialect
(service/ws/contexts.py). A sink method may raise ``SessionClosed``: the socket is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.synthesis.events import SpeechSink
from service.ws.live_input import LiveUtterance


CLOSE_OVERLOADED = 1013  # the WebSocket close code "try again later"


class SessionClosed(Exception):
    """The socket is gone or a fatal error was sent; stop the session."""


@dataclass(frozen=True)
class UtteranceStarted:
    index: int  # the session's utterances, counted from 0
    text: str  # "" for live text: it is still arriving (``live``)
    live: LiveUtterance | None = None


@dataclass(frozen=True)
class UtteranceDone:
    index: int
    samples: int  # audio sent for it, the fade after a cancel included
    duration_s: float
    cancelled: bool = False
    error: str | None = None  # "overloaded" (no room now: may be sent again) or "synthesis_failed"
    truncated: str | None = None  # UtteranceTruncated's reason
    behind_s: float = 0.0  # silence the listener heard inside it
    underruns: int = 0
    live: LiveUtterance | None = None  # live text: what its text turned out to be


@dataclass(frozen=True)
class RoundDone:
    utterances: int  # spoken in the round


@dataclass(frozen=True)
class SessionError:
    code: str
    message: str
    close_code: int = 0  # session_failed: the WebSocket close code the failure asks for


class SessionSink(SpeechSink):
    """Where a session core's events go: the events of speech (every one: SpeechSink), and the
    session's own."""

    async def utterance_started(self, event: UtteranceStarted) -> None:
        raise NotImplementedError

    async def utterance_done(self, event: UtteranceDone) -> None:
        raise NotImplementedError

    async def round_done(self, event: RoundDone) -> None:
        raise NotImplementedError

    async def session_error(self, event: SessionError) -> None:
        raise NotImplementedError

    async def session_failed(self, event: SessionError) -> None:
        """The session ended with this error (the core stopped before telling): write it, close."""
        raise NotImplementedError


__all__ = ["CLOSE_OVERLOADED", "RoundDone", "SessionClosed", "SessionError", "SessionSink", "UtteranceDone",
           "UtteranceStarted"]
