"""WebSocket live text: ``input.text`` deltas feed the open live utterance at once.

    live = LiveInput(boundary_chars=200)
    started, ended = live.add("Hello wor")     # -> utterances opened / whose text is complete
    ended = live.finish()                      # input.done, cancel, idle: the open utterance's text is complete

A live utterance's text goes to the engine through its :class:`~engines.contract.TextFeed`
as it arrives (the talker tokenizes it stably and speaks from the first text ids). Utterance
boundaries bound length and drift: once an utterance holds ``boundary_chars`` characters it
ends at the next sentence end (engines/text/sentences.py ``split_sentences``), and the text after
it opens the next utterance; text with no sentence end ends at its first space past
``HARD_FACTOR`` x ``boundary_chars``. Leading whitespace of an utterance is dropped and trailing
whitespace is held back until more text follows, so an utterance speaks ``text.strip()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.contract import TextFeed
from engines.text.sentences import SentenceSplitter


@dataclass
class LiveUtterance:
    text_start: int  # offset of the utterance's first character in the session's text
    feed: TextFeed = field(default_factory=TextFeed)
    text: str = ""  # what the feed has received
    held: str = ""  # trailing whitespace not fed yet
    # Its text + held as it arrived, split once (the last complete sentence's end is where a
    # long utterance may be cut): a delta costs its own length, not the utterance's.
    sentences: SentenceSplitter = field(default_factory=SentenceSplitter)
    seen: int = 0  # characters given to ``sentences``

    def add(self, delta: str) -> None:
        body = self.held + delta
        stripped = body.rstrip()
        self.held = body[len(stripped):]
        if stripped:
            self.feed.append(stripped)
            self.text += stripped

    def finish(self) -> None:
        self.held = ""
        self.feed.finish()


HARD_FACTOR = 4  # a live utterance with no sentence end is cut at a space past this x boundary_chars


class LiveInput:
    def __init__(self, boundary_chars: int):
        self.boundary_chars = boundary_chars
        self.hard_chars = HARD_FACTOR * boundary_chars  # no sentence end by then: the first space ends it
        self.open: LiveUtterance | None = None
        self.offset = 0  # characters of the session's text so far

    def add(self, delta: str) -> tuple[list[LiveUtterance], list[LiveUtterance]]:
        """-> (utterances opened, utterances whose text is complete) by this delta."""
        opened: list[LiveUtterance] = []
        ended: list[LiveUtterance] = []
        while delta:
            if self.open is None:  # an utterance opens at its first non-whitespace character
                start = len(delta) - len(delta.lstrip())
                self.offset += start
                delta = delta[start:]
                if not delta:
                    break
                self.open = LiveUtterance(self.offset)
                opened.append(self.open)
            u = self.open
            seen = u.seen
            cut = self._boundary(u, delta)
            if cut is None or cut < len(u.text):  # none yet, or one already fed (below the bound then)
                u.add(delta)
                self.offset += len(delta)
                break
            take = max(0, cut - seen)  # (a cut inside held whitespace takes none of the delta)
            u.add(delta[:take])
            self.offset += take
            delta = delta[take:]
            u.finish()
            ended.append(u)
            self.open = None
        return opened, ended

    def _boundary(self, u: LiveUtterance, delta: str) -> int | None:
        """End of the last complete sentence of the utterance's text with ``delta`` once past
        ``boundary_chars`` (sentence ends never move when more text arrives: the delta is
        read once); with none, text that runs on past ``hard_chars`` ends at its first space
        there (a long utterance drifts, and its stream's positions would cut it)."""
        u.sentences.feed(delta)
        offset = u.seen  # the utterance's index of delta[0]
        u.seen += len(delta)
        cut = u.seen - len(u.sentences.rest)
        if cut >= self.boundary_chars:
            return cut
        space = next((i for i in range(max(0, self.hard_chars - offset), len(delta)) if delta[i].isspace()), None)
        return None if space is None else offset + space

    def finish(self) -> LiveUtterance | None:
        """The open utterance's text is complete (input.done, cancel, idle, disconnect)."""
        u, self.open = self.open, None
        if u is not None:
            u.finish()
        return u


__all__ = ["LiveInput", "LiveUtterance"]
