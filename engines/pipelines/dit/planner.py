"""Admission-time planning of one request (runs once, outside the steady-state tick).

text -> clauses -> token ids -> encoder states (positive + null) -> durations ->
frame chunks. All clauses of a request are encoded in one padded batch. Frame indices
are global across the request's clauses, so the counter-based noise of two chunks
never collides and a request's audio depends only on its seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engines.hardware.devices import canonical_device, stage, upload
from engines.models.condition import ConditionEncoder
from engines.models.configs import ModelConfig, StreamConfig
from engines.models.duration import DurationModel
from engines.models.text import Tokenizer
from engines.text.sentences import split_clauses


@dataclass(frozen=True)
class ClausePlan:
    text: str
    token_ids: tuple[int, ...]
    enc: torch.Tensor  # [L, C] positive encoder states (one object for all chunks of the clause)
    enc_null: torch.Tensor  # [L, C] null states (an expanded view of the learned null embedding)
    frame_start: int  # global index of the clause's first frame
    frames_total: int
    chunks: tuple[tuple[int, int], ...]  # (global frame start, num frames), in order


def frames_total(plans: list[ClausePlan]) -> int:
    return sum(p.frames_total for p in plans)


def chunk_layout(frame_start: int, frames: int, first_chunk: int, chunk: int,
                 min_chunk: int = 1) -> tuple[tuple[int, int], ...]:
    """Cut ``frames`` frames starting at ``frame_start`` into a first chunk of
    ``first_chunk`` frames, then chunks of ``chunk`` frames. A last chunk smaller than
    ``min_chunk`` joins the chunk before it (a tiny last chunk would cost a whole
    denoising run for a few frames)."""
    if frames < 1 or first_chunk < 1 or chunk < 1:
        raise ValueError(f"chunk_layout needs positive sizes, got frames={frames}, first={first_chunk}, chunk={chunk}")
    sizes = [min(first_chunk, frames)]
    left = frames - sizes[0]
    while left > 0:
        sizes.append(min(chunk, left))
        left -= sizes[-1]
    if len(sizes) > 1 and sizes[-1] < min_chunk:
        last = sizes.pop()
        sizes[-1] += last
    out, start = [], frame_start
    for n in sizes:
        out.append((start, n))
        start += n
    return tuple(out)


class UtterancePlanner:
    def __init__(self, tokenizer: Tokenizer, encoder: ConditionEncoder, duration: DurationModel,
                 model_cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype = torch.float32):
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.duration = duration
        self.cfg = model_cfg
        self.stream_cfg: StreamConfig = model_cfg.stream
        self.device = canonical_device(device)
        self.dtype = dtype
        # A clause must fit the encoder (bos + eos included) and a prosodic budget.
        self.max_clause_tokens = min(model_cfg.text.max_clause_tokens, model_cfg.text.max_text_tokens - 2)

    def _measure(self, text: str) -> int:
        return len(self.tokenizer.encode(text)) - 2  # without bos/eos

    def plan(self, text: str, voice_index: int, speed: float = 1.0) -> list[ClausePlan]:
        """Clause plans for ``text``; ValueError on bad input (says which)."""
        [result] = self.plan_many([(text, voice_index, speed)])
        if isinstance(result, Exception):
            raise result
        return result

    def plan_many(self, requests: list[tuple[str, int, float]]) -> list[list[ClausePlan] | Exception]:
        """Plans for several requests ``(text, voice_index, speed)`` with ONE encoder and
        duration forward over all their clauses and one host read of the frame counts
        (on CUDA a request costs a few hundred kernel launches and a host read: planning a
        burst of arrivals one by one would delay all of them). A request with bad input gets
        its ValueError in its place; the others are planned. A failure of the batched
        forward itself propagates (the caller re-plans one by one to isolate it)."""
        results: list[list[ClausePlan] | Exception] = [ValueError("not planned")] * len(requests)
        clauses: list[tuple[int, int, str, list[int], int, float]] = []  # (request, index, text, ids, voice, speed)
        for r, (text, voice_index, speed) in enumerate(requests):
            try:
                self._check(text, voice_index, speed)
                for i, clause in enumerate(split_clauses(text, self.max_clause_tokens, measure=self._measure)):
                    clauses.append((r, i, clause, self.tokenizer.encode(clause), voice_index, float(speed)))
            except ValueError as exc:
                results[r] = exc
        if not clauses:
            return results
        with torch.inference_mode():
            token_ids, mask = self._pad([c[3] for c in clauses])
            voice = upload([c[4] for c in clauses], torch.long, self.device)
            speeds = upload([c[5] for c in clauses], torch.float32, self.device)
            enc = self.encoder(token_ids, voice, mask)  # [N, Lmax, C]
            special = upload([self.tokenizer.pad_id, self.tokenizer.bos_id, self.tokenizer.eos_id],
                             torch.long, self.device)
            speech_mask = mask & ~torch.isin(token_ids, special)
            frames = self.duration.frame_counts(self.duration(enc, speech_mask), speeds)
            starts: dict[int, int] = {}
            for row, ((r, i, clause, clause_ids, _, _), n) in enumerate(zip(clauses, frames)):
                if i == 0:
                    results[r] = []
                start = starts.get(r, 0)
                first = self.stream_cfg.first_chunk_frames if i == 0 else self.stream_cfg.chunk_frames
                L = len(clause_ids)
                results[r].append(ClausePlan(  # type: ignore[union-attr]
                    text=clause, token_ids=tuple(clause_ids),
                    enc=enc[row, :L].to(self.dtype, copy=True),  # own storage: the padded batch can be freed
                    enc_null=self.encoder.null_states(L, 1)[0].to(self.dtype),
                    frame_start=start, frames_total=n,
                    chunks=chunk_layout(start, n, first, self.stream_cfg.chunk_frames,
                                        min_chunk=self.stream_cfg.first_chunk_frames)))
                starts[r] = start + n
        return results

    def _check(self, text: str, voice_index: int, speed: float) -> None:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text must be a non-empty string")
        if not 0 <= voice_index < self.cfg.text.num_voices:
            raise ValueError(f"voice index {voice_index} outside [0, {self.cfg.text.num_voices})")
        if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be a positive finite number, got {speed!r}")

    def _pad(self, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        L = max(len(x) for x in ids)
        token_ids = torch.full((len(ids), L), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), L), dtype=torch.bool)
        for i, x in enumerate(ids):
            token_ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask[i, : len(x)] = True
        return stage(token_ids, self.device), stage(mask, self.device)
