"""Stable incremental tokenization of text that is still arriving.

    stream = StableTokenizer(tokenizer)          # a QwenTextTokenizer
    ids = stream.feed("Hel")                     # -> [] (the trailing piece may still change)
    ids += stream.feed("lo world")               # -> ids of "Hello" (" world" is held back)
    ids += stream.finish()                       # -> the rest
    assert ids == tokenizer.encode(wrap(text))[3:-5]   # the official body ids, for ANY split

Only ids that no later text can change are committed. The talker's body ids are
``encode("<|im_start|>assistant\\n" + text + "<|im_end|>\\n<|im_start|>assistant\\n")[3:-5]``
(prompt.py); the added token ``<|im_end|>`` splits the string before the regex, so the body
is the segment ``"assistant\\n" + text`` minus its first two ids. That segment is run
through NFC, split by the pre-tokenizer regex into pieces, and each piece is BPE-encoded on
its own. An id is therefore final once its piece is final, and a piece boundary ``b`` in the
pending text is final when:

- a later piece exists (the last piece can always grow or change, e.g. ``"a "`` + ``"b"``);
- the character before ``b`` is not whitespace: the only regex branches that scan ahead
  further than one character are the whitespace ones (``\\s*[\\r\\n]+``, ``\\s+(?!\\S)``), and
  a piece ending in a non-space character was decided by the character at ``b``, which
  exists already (checked for both split regexes by tests/engines/pipelines/talker/test_live_text.py);
- ``b`` lies before the last NFC starter (a later combining mark may compose with it) and
  before any trailing text that could still become an added token (``"<|im_"``).

The committed part is then dropped; the pending text restarts at ``b``, which splits the
same way the whole text does (the regex has no look-behind).
"""

from __future__ import annotations

import re
import unicodedata

from engines.checkpoints.qwen3_text import QwenTextTokenizer

ROLE = "<|im_start|>assistant\n"
ROLE_IDS = 3  # <|im_start|> "assistant" "\n": dropped like the official ids[3:-5]
TAIL = "<|im_end|>\n<|im_start|>assistant\n"


class StableTokenizer:
    """Feed text deltas, get the official body ids of the whole text, committed early."""

    def __init__(self, tokenizer: QwenTextTokenizer):
        self.tokenizer = tokenizer
        self._tok = tokenizer._tok  # the `tokenizers` object: offsets and pre-tokenizer pieces
        self._specials = [t.content for t in self._tok.get_added_tokens_decoder().values()]
        self._pending = ROLE  # NFC-normalised text not committed yet
        self._skip = ROLE_IDS  # role ids still to drop from the front of what commits
        self.committed: list[int] = []  # body ids
        self.role_ids: list[int] = []  # the role ids (ids[:3] of the wrapped text)
        self.finished = False

    def feed(self, delta: str) -> list[int]:
        """Append text; -> ids that became final (possibly none)."""
        if self.finished:
            raise ValueError("text after finish()")
        if not delta:
            return []
        self._pending = unicodedata.normalize("NFC", self._pending + delta)
        cut = self._final_boundary(self._pending)
        if cut <= 0:
            return []
        enc = self._tok.encode(self._pending[:cut], add_special_tokens=False)
        self._pending = self._pending[cut:]
        return self._commit(enc.ids)

    def finish(self) -> list[int]:
        """The text is complete: -> the remaining ids (the official body ids now all committed)."""
        if self.finished:
            return []
        self.finished = True
        ids = self._tok.encode(self._pending + TAIL, add_special_tokens=False).ids[:-5]
        self._pending = ""
        return self._commit(ids)

    def _commit(self, ids: list[int]) -> list[int]:
        drop = min(self._skip, len(ids))
        self._skip -= drop
        self.role_ids += ids[:drop]
        new = ids[drop:]
        self.committed += new
        return new

    def _final_boundary(self, text: str) -> int:
        """Largest piece boundary of ``text`` that no appended text can move (0: none)."""
        limit = self._before_partial_special(text)
        limit = min(limit, _last_starter(text))
        if limit <= 0:
            return 0
        # Added tokens split the text before the regex: work in the segment between the
        # last complete added token that ends by ``limit`` and the next one (or the end).
        spans = sorted((m.start(), m.start() + len(sp)) for sp in self._specials
                       for m in re.finditer(re.escape(sp), text))
        seg_start, seg_end = 0, len(text)
        for start, end in spans:
            if end <= limit:
                seg_start = max(seg_start, end)
            elif start >= seg_start:
                seg_end = min(seg_end, start)
        best = seg_start
        pieces = self._tok.pre_tokenizer.pre_tokenize_str(text[seg_start:seg_end])
        for _, (start, _end) in pieces[1:]:  # boundaries before the last piece only
            b = seg_start + start
            if b > limit:
                break
            if not text[b - 1].isspace():
                best = b
        return best

    def _before_partial_special(self, text: str) -> int:
        """Hold back a suffix that is a proper prefix of an added token (``"<|im_"``)."""
        cut = len(text)
        for s in self._specials:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return cut


def _last_starter(text: str) -> int:
    """Index of the last character a later combining mark could still compose with."""
    for i in range(len(text) - 1, -1, -1):
        if unicodedata.combining(text[i]) == 0:
            return i
    return 0


def body_ids(tokenizer: QwenTextTokenizer, text: str) -> list[int]:
    """The official body ids of a whole text (prompt.py's ids[3:-5])."""
    return tokenizer.encode(ROLE + text + TAIL)[ROLE_IDS:-5]


__all__ = ["StableTokenizer", "body_ids"]
