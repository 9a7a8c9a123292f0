"""Frame latents -> codes -> PCM, batched across requests, with decoder state per stream.

For every call: the frames of ALL items go through the codec head (code 0) and the code
predictor (codes 1..G-1) as one batch, in pieces of at most ``max_batch_rows``; sampling
is keyed by (seed, global frame, group), so a stream's codes do not depend on its batch
neighbours. Then each stream's codes go through the streaming codec decoder with that
stream's carried state; streams whose chunks have the same length decode together.

With a ``graphed_decoder`` (engines/runtime/graphed_decoder.py; the engine sets one on
CUDA) the decoder state lives in its static pool instead of ``_streams[...].state`` and
the chunks decode through its CUDA graphs; ``_streams`` still tracks ``next_frame``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engines.models.code_predictor import CodePredictor
from engines.models.codec_decoder import CodecDecoder, DecoderState
from engines.models.codec_head import CodecHead
from engines.models.sampling import FrameSampling
from engines.runtime.devices import canonical_device

if TYPE_CHECKING:
    from engines.runtime.graphed_decoder import GraphedDecoder


@dataclass(frozen=True)
class VocalizeItem:
    stream_id: str  # request id; decoder state is kept per stream
    latents: torch.Tensor | None  # [T, D] unit-RMS frame latents (None when ``codes`` are given)
    frame_offset: int  # global index of latents[0] in the utterance (sampling counters)
    seed: int
    greedy: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    is_last: bool = False  # drop the stream's decoder state after this item
    codes: torch.Tensor | None = None  # [T, G] codes already known (talker source): decode only

    @property
    def num_frames(self) -> int:
        return self.codes.shape[0] if self.codes is not None else self.latents.shape[0]  # type: ignore[union-attr]


@dataclass(frozen=True)
class VocalizeResult:
    stream_id: str
    codes: torch.Tensor  # [T, G] int64 (code 0 first)
    pcm: torch.Tensor  # [T * 1920] float32 (on the model device)


@dataclass
class _Stream:
    state: DecoderState | None  # decoder state, batch 1 (None: it lives in the graphed decoder's pool)
    next_frame: int  # frame_offset the stream's next item must have


def frame_codes(head: CodecHead, predictor: CodePredictor, latents: torch.Tensor, sampling: FrameSampling,
                naive: bool = False) -> torch.Tensor:
    """latents [N, D] -> codes [N, G] (code 0 from the head, 1..G-1 from the predictor)."""
    h = head.hidden(latents)
    code0 = head.sample_code0(head.logits_from_hidden(h), sampling)
    predict = predictor.naive_predict if naive else predictor.predict
    rest = predict(h, head.embed(code0), sampling)
    return torch.cat([code0[:, None], rest], dim=1)


@torch.no_grad()
def reference_codes(head: CodecHead, predictor: CodePredictor, latents: torch.Tensor, seed: int, frame_offset: int,
                    greedy: bool = True, temperature: float = 0.9, top_k: int = 50, top_p: float = 1.0) -> torch.Tensor:
    """Naive reference for one stream: no KV cache, each predictor step recomputes the whole sequence.
    latents [T, D] -> codes [T, G]."""
    p = next(predictor.parameters())
    latents = latents.to(p.device, p.dtype)
    s = FrameSampling.for_stream(latents.shape[0], seed, frame_offset, p.device, greedy, temperature, top_k, top_p)
    return frame_codes(head, predictor, latents, s, naive=True)


class Vocalizer:
    def __init__(self, head: CodecHead, predictor: CodePredictor, decoder: CodecDecoder, device,
                 dtype: torch.dtype = torch.float32, max_batch_rows: int = 512,
                 graphed_decoder: GraphedDecoder | None = None):
        hc, pc, dc = head.cfg, predictor.cfg, decoder.cfg
        if hc.hidden_size != pc.talker_hidden_size:
            raise ValueError(f"codec head width {hc.hidden_size} != predictor talker_hidden_size {pc.talker_hidden_size}")
        if not (hc.codebook_size == pc.vocab_size == dc.codebook_size):
            raise ValueError(f"codebook sizes differ: head {hc.codebook_size}, predictor {pc.vocab_size}, "
                             f"decoder {dc.codebook_size}")
        if pc.num_code_groups != dc.num_quantizers:
            raise ValueError(f"predictor num_code_groups {pc.num_code_groups} != decoder num_quantizers "
                             f"{dc.num_quantizers}")
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.device, self.dtype, self.max_batch_rows = canonical_device(device), dtype, max_batch_rows
        self.head = head.to(self.device, dtype).eval()
        self.predictor = predictor.to(self.device, dtype).eval()
        self.decoder = decoder.to(self.device, dtype).eval()
        self.latent_dim, self.num_code_groups = hc.hidden_size, pc.num_code_groups
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

    def open_streams(self) -> int:
        return len(self._streams)

    def close(self, stream_id: str) -> None:
        """Forget a stream's decoder state (cancel); unknown ids are ignored."""
        self._streams.pop(stream_id, None)
        if self._graphed_decoder is not None:
            self._graphed_decoder.release(stream_id)

    @torch.no_grad()
    def vocalize(self, items: list[VocalizeItem]) -> list[VocalizeResult]:
        """Codes and PCM for each item, in the same order. Items of one stream are decoded in order."""
        self._validate(items)
        codes = self._codes(items)
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
            if it.codes is not None:
                c = it.codes
                if c.dim() != 2 or c.shape[1] != self.num_code_groups or c.dtype != torch.int64:
                    raise ValueError(f"stream {it.stream_id!r}: codes must be int64 [T, {self.num_code_groups}], "
                                     f"got {c.dtype} {tuple(c.shape)}")
                lat = None
            else:
                lat = it.latents
            if lat is None and it.codes is None:
                raise ValueError(f"stream {it.stream_id!r}: give latents or codes")
            if lat is not None and (lat.dim() != 2 or lat.shape[1] != self.latent_dim):
                raise ValueError(f"stream {it.stream_id!r}: latents must be [T, {self.latent_dim}], got {tuple(lat.shape)}")
            if lat is not None and not lat.is_floating_point():
                raise ValueError(f"stream {it.stream_id!r}: latents must be floating point, got {lat.dtype}")
            if it.frame_offset < 0:
                raise ValueError(f"stream {it.stream_id!r}: frame_offset must be >= 0, got {it.frame_offset}")
            if not it.greedy and it.temperature <= 0:
                raise ValueError(f"stream {it.stream_id!r}: temperature must be > 0, got {it.temperature}")
            if not 0 < it.top_p <= 1:
                raise ValueError(f"stream {it.stream_id!r}: top_p must be in (0, 1], got {it.top_p}")
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

    def _codes(self, items: list[VocalizeItem]) -> list[torch.Tensor]:
        """All frames of all items as one batch (pieces of max_batch_rows) -> codes [T_i, G] per item."""
        lengths = [it.num_frames for it in items]
        # Items with known codes (talker source) skip prediction.
        active = [i for i, n in enumerate(lengths) if n > 0 and items[i].codes is None]  # active -> original index
        out = [torch.empty(0, self.num_code_groups, dtype=torch.int64, device=self.device) if it.codes is None
               else it.codes.to(self.device) for it in items]
        if not active:
            return out
        latents = torch.cat([items[i].latents.to(self.device, self.dtype) for i in active])  # [N, D]
        sampling = FrameSampling.for_streams([(items[i].num_frames, items[i].seed, items[i].frame_offset,
                                               items[i].greedy, items[i].temperature, items[i].top_k, items[i].top_p)
                                              for i in active], self.device)
        pieces = []
        for start in range(0, latents.shape[0], self.max_batch_rows):
            sl = slice(start, start + self.max_batch_rows)
            pieces.append(frame_codes(self.head, self.predictor, latents[sl], sampling.rows(sl)))
        codes = torch.cat(pieces)  # [N, G]
        for i, c in zip(active, codes.split([lengths[i] for i in active])):
            out[i] = c
        return out

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
