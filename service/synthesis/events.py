"""The typed events of speech being played, one stream of them for every protocol: a WebSocket
session's core (service/ws/core.py) and the HTTP speech service (service/speech.py) emit them
to a :class:`SpeechSink`, which writes its own wire format.

Per utterance (``index``: the utterances of the session or of the request, counted from 0): its
:class:`Audio`, with :class:`StreamBehind` before audio that comes after the listener ran out and
:class:`UtteranceTruncated` where the engine ended it early, then :class:`AlignmentReady` after
its audio when word timestamps were asked for. Every sink receives every event and decides what
it writes: a protocol with no message for one may log it or ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.contract import Alignment


@dataclass(frozen=True)
class Audio:
    index: int
    pcm: np.ndarray  # float32 mono at the engine's rate; after a cancel, a short fade to silence


@dataclass(frozen=True)
class StreamBehind:
    """The audio that follows comes after the listener ran out (the engine is slower than real time)."""

    index: int
    gap_s: float  # the silence before it
    behind_s: float  # the stream's silences so far


@dataclass(frozen=True)
class UtteranceTruncated:
    """The engine ended an utterance that did not end by itself (a runaway)."""

    index: int
    reason: str


@dataclass(frozen=True)
class AlignmentReady:
    index: int
    alignment: Alignment  # word times from the utterance's start
    offset_ms: float  # where the utterance starts on the stream's audio clock


class SpeechSink:
    """Where the events of speech go: each protocol implements every one (see the module docstring)."""

    async def audio(self, event: Audio) -> None:
        raise NotImplementedError

    async def stream_behind(self, event: StreamBehind) -> None:
        raise NotImplementedError

    async def utterance_truncated(self, event: UtteranceTruncated) -> None:
        raise NotImplementedError

    async def alignment(self, event: AlignmentReady) -> None:
        raise NotImplementedError


__all__ = ["AlignmentReady", "Audio", "SpeechSink", "StreamBehind", "UtteranceTruncated"]
