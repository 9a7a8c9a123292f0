"""Text frontend of the DiT: a byte-level tokenizer.

* :class:`ByteTokenizer` maps UTF-8 bytes to ids 0..255 plus three special ids
  (pad 256, bos 257, eos 258). It needs no files and covers every language.
* :class:`Tokenizer` is what the planner needs from a tokenizer.

Sentence and clause splitting, which the service uses too, is engines/text/sentences.py.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
BYTE_VOCAB_SIZE = 259


@runtime_checkable
class Tokenizer(Protocol):
    """What the planner needs from a tokenizer."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` wrapped as [bos, ..., eos]."""

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special ids are skipped."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; pad/bos/eos are 256/257/258."""

    vocab_size = BYTE_VOCAB_SIZE
    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return [BOS_ID, *text.encode("utf-8"), EOS_ID]

    def decode(self, ids: list[int]) -> str:
        data = bytearray()
        for i in ids:
            if not 0 <= i < BYTE_VOCAB_SIZE:
                raise ValueError(f"token id {i} outside the byte vocabulary [0, {BYTE_VOCAB_SIZE})")
            if i < 256:
                data.append(i)
        return data.decode("utf-8", errors="replace")
