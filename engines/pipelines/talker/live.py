"""Live rows in the talker batch: text that keeps arriving while a row decodes. The host's rule
(:func:`rows_waiting_for_text`, batch.py calls it every tick on any device): newly committed text
ids of a live row go to its runner, and a row whose next step needs text that has not arrived sits
the step out (its state untouched). The device half (:class:`TextParts`): those ids as text parts in
the row's ``trail``. One utterance's text side is live_text.py."""

from __future__ import annotations

from typing import Callable

import torch

from engines.models.talker import Talker
from engines.pipelines.talker.rows import RowState, Utterance


def rows_waiting_for_text(utts: dict[int, Utterance], write: Callable[[Utterance, list[int], bool], None]) -> set[int]:
    """Hand each live row's newly committed trailing text ids to ``write`` (``u.fed`` counts them);
    -> the rows whose next decode step needs a text id that has not arrived yet. Decode step k adds
    trailing text id k (live_text.py), so a row may take step k once k ids are there or its text is
    complete."""
    waiting: set[int] = set()
    for row, u in utts.items():
        if u.live is None:
            continue
        u.live.pull()
        ids = u.live.trailing_ids()
        if len(ids) > u.fed:
            write(u, ids[u.fed:], u.live.done)
            u.fed = len(ids)
        steps = u.next_pos - u.prompt_len  # decode step k of the row's next tick
        if not u.live.done and steps >= u.fed:
            waiting.add(row)
    return waiting


class TextParts:
    """The device half: committed text ids as text parts in the rows' ``trail`` (decode.py reads
    part k at step k, then the tts_pad part)."""

    def __init__(self, talker: Talker, state: RowState, tts_pad_token_id: int, device):
        self.talker = talker
        self.state = state
        self.tts_pad_token_id = tts_pad_token_id
        self.device = device
        self._pad_part: torch.Tensor | None = None  # the tts_pad text part, made once

    @property
    def pad_part(self) -> torch.Tensor:
        if self._pad_part is None:
            pad = torch.tensor([self.tts_pad_token_id], dtype=torch.long, device=self.device)
            self._pad_part = self.talker.text_part(pad)[0]
        return self._pad_part

    def write(self, u: Utterance, ids: list[int], done: bool) -> None:
        """Row ``u.row``'s trailing parts ``u.fed`` on from ``ids``; after them tts_pad once ``done``."""
        st, start, end = self.state, u.fed, u.fed + len(ids)
        new = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        st.ensure_trail(end + 1)
        st.trail[u.row, start:end] = self.talker.text_part(new)
        st.trail_len[u.row] = end
        if done:
            st.trail[u.row, end] = self.pad_part


__all__ = ["TextParts", "rows_waiting_for_text"]
