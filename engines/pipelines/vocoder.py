"""Code frames -> PCM: the streaming codec decoder with state per stream, batched across streams.

Every pipeline emits code frames [T, G]; this module only decodes them. Each stream's
codes go through the streaming codec decoder with that stream's carried state; streams
whose chunks have the same length decode together.

With a ``graphed_decoder`` (engines/runtime/graphed_decoder.py; the engine sets one on
CUDA) the decoder state lives in its static pool instead of ``_streams[...].state`` and
the chunks decode through its CUDA graphs; ``_streams`` still tracks ``next_frame``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engines.devices import canonical_device
from engines.models.codec_decoder import CodecDecoder, DecoderState

if TYPE_CHECKING:
    from engines.runtime.graphed_decoder import GraphedDecoder


@dataclass(frozen=True)
class VocalizeItem:
    stream_id: str  # request id; decoder state is kept per stream
    codes: torch.Tensor  # [T, G] int64 code frames
    frame_offset: int  # global index of codes[0] in the utterance (chunks of a stream are contiguous)
    is_last: bool = False  # drop the stream's decoder state after this item

    @property
    def num_frames(self) -> int:
        return self.codes.shape[0]


@dataclass(frozen=True)
class VocalizeResult:
    stream_id: str
    codes: torch.Tensor  # [T, G] int64 (code 0 first)
    pcm: torch.Tensor  # [T * 1920] float32 (on the model device)


@dataclass
class _Stream:
    state: DecoderState | None  # decoder state, batch 1 (None: it lives in the graphed decoder's pool)
    next_frame: int  # frame_offset the stream's next item must have


class Vocalizer:
    def __init__(self, decoder: CodecDecoder, device, dtype: torch.dtype = torch.float32,
                 graphed_decoder: GraphedDecoder | None = None):
        self.device, self.dtype = canonical_device(device), dtype
        self.decoder = decoder.to(self.device, dtype).eval()
        self.num_code_groups, self.codebook_size = decoder.cfg.num_quantizers, decoder.cfg.codebook_size
        self.samples_per_frame = decoder.samples_per_frame
        self._streams: dict[str, _Stream] = {}
        self._graphed_decoder: GraphedDecoder | None = None
        self.graphed_decoder = graphed_decoder

    @property
    def graphed_decoder(self) -> GraphedDecoder | None:
        """The pooled / CUDA-graphed streaming decoder, or None (plain ``decode_step`` per call)."""
        return self._graphed_decoder

    @graphed_decoder.setter
    def graphed_decoder(self, graphed: GraphedDecoder | None) -> None:
        if graphed is not None:
            if graphed.decoder is not self.decoder:
                raise ValueError("the graphed decoder must wrap this vocalizer's decoder")
            if graphed.device != self.device or graphed.dtype != self.dtype:
                raise ValueError(f"graphed decoder on {graphed.device}/{graphed.dtype}, vocalizer on "
                                 f"{self.device}/{self.dtype}")
        if self._streams and graphed is not self._graphed_decoder:
            raise RuntimeError("cannot change the decoder while streams are open")
        self._graphed_decoder = graphed

    # ------------------------------------------------------------------ public API

    def capture_graphs(self) -> None:
        """CUDA: capture the graphed decoder's graphs now (engine start, before /readyz)."""
        if self._graphed_decoder is not None:
            self._graphed_decoder.capture_all()

    @torch.no_grad()
    def prime(self, stream_id: str, codes: torch.Tensor) -> None:
        """Run the decoder over frames that precede a stream and drop their audio: in-context
        cloning's reference codes, which the official decode puts before the generated ones
        (its streaming state needs every reference frame). The stream's frames then count from 0."""
        if codes.shape[0] == 0:
            return
        self.vocalize([VocalizeItem(stream_id, codes.to(self.device), frame_offset=0)])
        self._streams[stream_id].next_frame = 0

    def open_streams(self) -> int:
        return len(self._streams)

    def close(self, stream_id: str) -> None:
        """Forget a stream's decoder state (cancel); unknown ids are ignored."""
        self._streams.pop(stream_id, None)
        if self._graphed_decoder is not None:
            self._graphed_decoder.release(stream_id)

    @torch.no_grad()
    def vocalize(self, items: list[VocalizeItem]) -> list[VocalizeResult]:
        """PCM for each item, in the same order. Items of one stream are decoded in order."""
        self._validate(items)
        codes = [it.codes.to(self.device) for it in items]
        pcm = self._decode(items, codes)
        for it in items:
            if it.is_last:
                self._streams.pop(it.stream_id, None)
        return [VocalizeResult(it.stream_id, c, p) for it, c, p in zip(items, codes, pcm)]

    # ------------------------------------------------------------------ steps

    def _validate(self, items: list[VocalizeItem]) -> None:
        """Check everything up front so a bad item fails the call before any state changes."""
        expected: dict[str, int] = {}
        for it in items:
            c = it.codes
            if c.dim() != 2 or c.shape[1] != self.num_code_groups or c.dtype != torch.int64:
                raise ValueError(f"stream {it.stream_id!r}: codes must be int64 [T, {self.num_code_groups}], "
                                 f"got {c.dtype} {tuple(c.shape)}")
            if it.frame_offset < 0:
                raise ValueError(f"stream {it.stream_id!r}: frame_offset must be >= 0, got {it.frame_offset}")
            # The decoder carries state frame by frame: chunks must follow each other without gaps.
            if it.stream_id in expected:
                want = expected[it.stream_id]
            elif it.stream_id in self._streams:
                want = self._streams[it.stream_id].next_frame
            else:
                want = it.frame_offset  # a new stream may start anywhere
            if it.frame_offset != want:
                raise ValueError(f"stream {it.stream_id!r}: frame_offset {it.frame_offset} but the decoder is at "
                                 f"frame {want} (chunks must be contiguous)")
            expected[it.stream_id] = it.frame_offset + it.num_frames

    def _decode(self, items: list[VocalizeItem], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Streaming decode; round r holds the r-th item of every stream, so a stream's chunks stay in order."""
        if self._graphed_decoder is not None:
            return self._decode_graphed(items, codes)
        pcm: list[torch.Tensor | None] = [None] * len(items)
        rounds: list[list[int]] = []
        seen: dict[str, int] = defaultdict(int)
        for i, it in enumerate(items):
            r = seen[it.stream_id]
            seen[it.stream_id] += 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(i)
        for round_items in rounds:
            by_length: dict[int, list[int]] = defaultdict(list)
            for i in round_items:
                by_length[codes[i].shape[0]].append(i)
            for t, group in by_length.items():
                if t == 0:
                    for i in group:
                        pcm[i] = torch.empty(0, device=self.device, dtype=torch.float32)
                    continue
                states = [self._stream_state(items[i].stream_id) for i in group]
                batch_codes = torch.stack([codes[i].T for i in group])  # [n, G, t]
                wav, new_state = self.decoder.decode_step(batch_codes, DecoderState.cat(states))
                for row, (i, st) in enumerate(zip(group, new_state.split() if len(group) > 1 else [new_state])):
                    self._streams[items[i].stream_id] = _Stream(st, items[i].frame_offset + t)
                    pcm[i] = wav[row].float()
        return pcm  # type: ignore[return-value]

    def _decode_graphed(self, items: list[VocalizeItem], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """The same per-stream decode through the graphed decoder's state pool (it orders rounds itself
        and releases the rows of ``is_last`` streams)."""
        wavs = self._graphed_decoder.decode([(it.stream_id, c, it.is_last) for it, c in zip(items, codes)])
        for it, c in zip(items, codes):
            if c.shape[0]:
                self._streams[it.stream_id] = _Stream(None, it.frame_offset + c.shape[0])
        if not wavs:
            return []
        # One cast for the whole call (not one kernel per stream); the pieces are views.
        return list(torch.cat(wavs).float().split([w.numel() for w in wavs]))

    def _stream_state(self, stream_id: str) -> DecoderState:
        """A known stream's carried state, or a fresh one (decoder positions count from its first chunk)."""
        stream = self._streams.get(stream_id)
        return stream.state if stream is not None else self.decoder.init_state(1, self.device, self.dtype)
