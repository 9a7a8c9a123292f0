"""A session's text, cut into utterances and queued in order with the ends of its rounds.

Sentence mode: text is cut at sentence ends (engines/text/sentences.py ``SentenceSplitter``, each
character read once) and each sentence is one utterance. Live text (service/ws/live_input.py):
an utterance opens at the first text and its feed takes every later delta at once; a break tag
(service/synthesis/breaks.py) ends it and is spoken as its own utterance, a pause; a delta with a
malformed tag is refused whole (ApiError(400) from :meth:`UtteranceQueue.add`).

    queue = UtteranceQueue(live_boundary_chars=200)
    queue.add("Hello there. How", live=False)   # queues "Hello there."
    queue.end_round()                           # queues "How", then the end of the round
    item = await queue.next()                   # an Utterance or an EndOfRound, in order

Every count the session's limits read is kept in step with the queue (never recomputed by
walking it): the characters queued, the rounds queued, and the rounds a cancel ended, which are
answered before anything queued after them.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Iterable

from engines.text.sentences import SentenceSplitter
from service.errors import ApiError
from service.synthesis.breaks import BreakTags, Pause, break_tag
from service.ws.live_input import LiveInput, LiveUtterance


@dataclass
class Utterance:
    text: str
    refused: bool = False  # over the work limit: the error was sent once, it is skipped
    live: LiveUtterance | None = None  # text still arriving (service/ws/live_input.py)


@dataclass
class EndOfRound:
    """Where an ``input.done`` (or a cancel) ends a round: the round's end is answered here."""


class UtteranceQueue:
    def __init__(self, live_boundary_chars: int):
        self._items: collections.deque[Utterance | EndOfRound] = collections.deque()
        self._queued_text = 0  # characters of the queued utterances
        self._queued_rounds = 0  # EndOfRound markers in the queue
        self._cancelled_rounds = 0  # rounds ended by a cancel, answered before anything queued
        self._wake = asyncio.Event()
        self._sentences = SentenceSplitter()  # text not yet ending in a sentence boundary, read once
        self._live = LiveInput(live_boundary_chars)
        self._breaks = BreakTags()  # live text: a break tag cut between deltas waits for its end

    # -- what the session's limits read ------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Utterances or round ends wait (text still waiting for a sentence end is not work yet)."""
        return bool(self._items) or self._cancelled_rounds > 0

    @property
    def pending_rounds(self) -> int:
        """Rounds (ended by the client or by a cancel) not answered yet."""
        return self._queued_rounds + self._cancelled_rounds

    def waiting_chars(self) -> int:
        """Text not spoken yet: queued, waiting for a sentence end, or in the open live utterance."""
        open_live = self._live.open
        live = len(open_live.text) + len(open_live.held) if open_live is not None else 0
        return len(self._sentences.rest) + self._queued_text + live

    def upcoming(self) -> Utterance | None:
        """The utterance spoken next, when nothing comes before it (what a prefetch submits)."""
        item = self._items[0] if self._items else None
        return item if isinstance(item, Utterance) else None

    # -- text in -------------------------------------------------------------------------
    def add(self, text: str, live: bool) -> None:
        """Queue ``text``; live text with a malformed break tag: ApiError(400), nothing of it queued."""
        if live:
            self._add_live(self._breaks.feed(text))
        else:
            self._enqueue(Utterance(s) for s in self._sentences.feed(text))  # reads only the new text

    def _add_live(self, pieces: Iterable[str | Pause]) -> None:
        """Text feeds the open live utterance (opening one when none is); a break tag ends it
        and is spoken as its own utterance, a pause."""
        for piece in pieces:
            if isinstance(piece, Pause):
                self._live.finish()
                self._enqueue([Utterance(break_tag(piece))])
            else:
                opened, _ended = self._live.add(piece)
                self._enqueue(Utterance("", live=u) for u in opened)

    def finish_live(self) -> bool:
        """The open live utterance's text is complete (idle client, a change of mode): its
        audio follows. False when none was open."""
        return self._live.finish() is not None

    def end_round(self) -> None:
        """The client ended a round: what it holds is spoken, then the round's end; then
        ApiError(400) when its live text ended inside a break tag (which is not spoken)."""
        try:
            held, error = self._breaks.take_rest(), None  # held text that could begin no tag is text
        except ApiError as exc:
            held, error = [], exc
        self._add_live(held)
        self._live.finish()
        rest = self._sentences.take_rest().strip()
        items: list[Utterance | EndOfRound] = [Utterance(rest)] if rest else []
        self._enqueue(items + [EndOfRound()])
        if error is not None:
            raise error

    def cancel(self) -> None:
        """A cancel: queued text is dropped; the rounds it held end (answered first, in order,
        so every round's end is answered exactly once), and so does the cancel's own round."""
        self._sentences.take_rest()
        self._breaks.drop()
        self._live.finish()
        self._cancelled_rounds += self._queued_rounds + 1
        self._clear()
        self._wake.set()

    def drop(self) -> None:
        """The session ends: nothing queued is spoken or answered."""
        self._live.finish()
        self._clear()
        self._cancelled_rounds = 0

    # -- the speaker's side --------------------------------------------------------------
    async def next(self) -> Utterance | EndOfRound:
        while not self._items and not self._cancelled_rounds:
            self._wake.clear()
            await self._wake.wait()
        if self._cancelled_rounds:  # rounds ended by a cancel precede everything queued now
            self._cancelled_rounds -= 1
            return EndOfRound()
        item = self._items.popleft()
        if isinstance(item, Utterance):
            self._queued_text -= len(item.text)
        else:
            self._queued_rounds -= 1
        return item

    def _enqueue(self, items: Iterable[Utterance | EndOfRound]) -> None:
        for item in items:
            if isinstance(item, Utterance):
                self._queued_text += len(item.text)
            else:
                self._queued_rounds += 1
            self._items.append(item)
        self._wake.set()

    def _clear(self) -> None:
        self._items.clear()
        self._queued_text = 0
        self._queued_rounds = 0


__all__ = ["EndOfRound", "Utterance", "UtteranceQueue"]
