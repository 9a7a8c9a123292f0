"""Live rows in the talker batch: text that keeps arriving while a row decodes. Newly committed
text parts are written into the row's ``trail``; a row whose next step needs text that has not
arrived sits the step out (its state untouched). One utterance's text side is live_text.py."""

from __future__ import annotations

import torch

from engines.models.talker import Talker
from engines.pipelines.talker.rows import RowState, Utterance


class LiveRows:
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

    def feed(self, utts: dict[int, Utterance]) -> set[int]:
        """Write newly committed text parts of live rows into ``trail``; -> the rows whose
        next decode step needs a text id that has not arrived yet."""
        waiting: set[int] = set()
        st = self.state
        for row, u in utts.items():
            if u.live is None:
                continue
            u.live.pull()
            ids = u.live.trailing_ids()
            if len(ids) > u.fed:
                new = torch.tensor(ids[u.fed:], dtype=torch.long).to(self.device, non_blocking=True)
                st.ensure_trail(len(ids) + 1)
                st.trail[row, u.fed:len(ids)] = self.talker.text_part(new)
                u.fed = len(ids)
                st.trail_len[row] = u.fed
                if u.live.done:
                    st.trail[row, u.fed] = self.pad_part
            steps = u.next_pos - u.prompt_len  # decode step k of the row's next tick
            if not u.live.done and steps >= u.fed:
                waiting.add(row)
        return waiting


__all__ = ["LiveRows"]
