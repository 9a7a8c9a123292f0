"""Code frames -> PCM: the streaming codec decoder with state per stream, batched across streams.

Every pipeline emits code frames [T, G]; this module only decodes them. Each stream's
codes go through the streaming codec decoder with that stream's carried state; streams
whose chunks have the same length decode together.

In a reduced precision (bf16: the CPU default, ``--codec-precision auto``) every op rounds its
result to 8 significant bits, and the kernels a chunk's shapes select round differently: the
same codes cut into other chunks came out hundreds of LSB apart, so a stream's audio followed
the load. There the decoder runs on **fixed windows** (``windowed``): each stream is decoded
alone, one window at a time, windows at fixed frames of the stream (1, 1 and 2 frames, then
``WINDOW_FRAMES`` each: a stream's first chunks are that small, and the scheduler ends longer
chunks on window ends), on one thread; a chunk
that ends inside a window decodes the whole window, its missing frames padded, and returns only
its own frames' samples; the stream's state stays at the window's start until the window is
complete, when it is decoded again and its remaining samples returned. The decoder is causal,
and a kernel of fixed shapes computes each row from that row alone (checked in
tests/engines/pipelines/test_vocalizer_windows.py), so the padding never reaches the samples
returned: every op sees the same shapes whatever the chunking, batch or thread count around
it, and the PCM is the same to the bit.

With a ``graphed_decoder`` (engines/runtime/graphed_decoder.py; the engine sets one on
CUDA) the decoder state lives in its static pool instead of ``_streams[...].state`` and
the chunks decode through its CUDA graphs; ``_streams`` still tracks ``next_frame``.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from engines.hardware.devices import canonical_device
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


# Fixed windows (reduced precision): the sizes of a stream's first windows, then every window's.
# At the released sizes, 1 thread, bf16: 25 ms of CPU per frame in windows of 4, 23 in one long
# call, 49 for a frame alone. A stream's first chunk is one frame and its next ones grow from there
# (core/scheduler.py), which these windows follow; the scheduler ends chunks of WINDOW_FRAMES or
# more on window ends (its ``align_frames``), so they decode no padding
# (benchmarks/bench_codec_windows.py).
WINDOW_RAMP = (1, 1, 2)
WINDOW_FRAMES = 4
WINDOW_THREADS = 1  # a kernel's rounding may follow its thread count (oneDNN splits some reductions)


def rounds_per_chunk_shape(dtype: torch.dtype) -> bool:
    """Whether a decoder in ``dtype`` rounds its results enough for the chunk shapes to show in
    the PCM (bf16, fp16: it then decodes on fixed windows)."""
    return dtype not in (torch.float32, torch.float64)


def window_frames(position: int) -> int:
    """Frames of the window that starts at a stream's frame ``position`` (a window start)."""
    start = 0
    for size in WINDOW_RAMP:
        if position == start:
            return size
        start += size
    return WINDOW_FRAMES


@dataclass
class _Stream:
    state: DecoderState | None  # decoder state, batch 1 (None: it lives in the graphed decoder's pool)
    next_frame: int  # frame_offset the stream's next item must have
    # Fixed windows: ``state`` is at the start of the open window, ``position`` frames into the
    # stream (priming not counted); ``partial`` holds the open window's frames already returned
    # ([n, G], n < its size).
    position: int = 0
    partial: torch.Tensor | None = None


class Vocalizer:
    def __init__(self, decoder: CodecDecoder | None, device, dtype: torch.dtype = torch.float32,
                 graphed_decoder: GraphedDecoder | None = None, windowed: bool | None = None):
        """``windowed``: decode on fixed windows (None: in a reduced precision, where chunk shapes
        would change the PCM; the module's docstring). ``decoder`` None: every chunk goes to
        ``graphed_decoder`` (a virtual device's, engines/virtual/vocoder.py: its ``num_code_groups``,
        ``codebook_size`` and ``samples_per_frame`` stand for the decoder's)."""
        self.device, self.dtype = canonical_device(device), dtype
        self.windowed = rounds_per_chunk_shape(dtype) if windowed is None else windowed
        shape = decoder if decoder is not None else graphed_decoder
        if shape is None:
            raise ValueError("a vocalizer needs a decoder or a graphed decoder")
        self.decoder = decoder.to(self.device, dtype).eval() if decoder is not None else None
        if decoder is not None:
            self.num_code_groups, self.codebook_size = decoder.cfg.num_quantizers, decoder.cfg.codebook_size
        else:
            self.num_code_groups, self.codebook_size = graphed_decoder.num_code_groups, graphed_decoder.codebook_size
        self.samples_per_frame = shape.samples_per_frame
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
            if self.windowed:
                raise ValueError("a graphed decoder decodes chunks of any length: not with fixed windows")
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
        if self.windowed:  # windows of a fixed size, the rest as one exact call: the stream's windows start after them
            with _threads(WINDOW_THREADS):
                state = self.decoder.init_state(1, self.device, self.dtype)
                for window in codes.to(self.device).split(WINDOW_FRAMES):
                    _, state = self.decoder.decode_step(window.T[None], state)
            self._streams[stream_id] = _Stream(state, 0)
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
        if self.windowed:
            with _threads(WINDOW_THREADS):
                pcm = self._decode_windowed(items, codes)
        else:
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

    def _decode_windowed(self, items: list[VocalizeItem], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each item on fixed windows (the module's docstring), stream by stream, in order. The
        streams' new states are kept only once every item decoded (a failed call changes none)."""
        streams: dict[str, _Stream] = {}
        pcm = []
        for it, c in zip(items, codes):
            stream = streams.get(it.stream_id) or self._streams.get(it.stream_id) or _Stream(
                self.decoder.init_state(1, self.device, self.dtype), it.frame_offset)
            wav, streams[it.stream_id] = self._windows(stream, c)
            pcm.append(wav)
        self._streams.update(streams)
        return pcm

    def _windows(self, stream: _Stream, codes: torch.Tensor) -> tuple[torch.Tensor, _Stream]:
        """``codes`` [T, G] decoded after ``stream``: (their PCM [T * 1920] float32, the stream after them)."""
        done = 0 if stream.partial is None else stream.partial.shape[0]  # frames of the open window returned
        frames = codes if not done else torch.cat([stream.partial, codes])
        state, position, start, pieces, partial = stream.state, stream.position, 0, [], None
        while start < frames.shape[0]:
            size = window_frames(position)
            window = frames[start:start + size]
            n = window.shape[0]
            if n < size:  # padded: causal, so the padding reaches none of the n frames' samples
                partial = window
                window = torch.cat([window, window.new_zeros(size - n, window.shape[1])])
            wav, after = self.decoder.decode_step(window.T[None], state)
            skip = max(done - start, 0)  # frames of this window returned by an earlier call
            pieces.append(wav[0, skip * self.samples_per_frame:n * self.samples_per_frame])
            if partial is None:
                state, position = after, position + size
            start += size
        pcm = torch.cat(pieces).float() if pieces else torch.empty(0, device=self.device, dtype=torch.float32)
        return pcm, _Stream(state, stream.next_frame + codes.shape[0], position, partial)

    def _decode_graphed(self, items: list[VocalizeItem], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """The same per-stream decode through the graphed decoder's state pool (it orders rounds itself
        and releases the rows of ``is_last`` streams)."""
        wavs = self._graphed_decoder.decode([(it.stream_id, c, it.is_last) for it, c in zip(items, codes)])
        for it, c in zip(items, codes):
            if c.shape[0]:
                self._streams[it.stream_id] = _Stream(None, it.frame_offset + c.shape[0])
        if not wavs or all(w.dtype == torch.float32 for w in wavs):
            return list(wavs)  # (they alias no static buffer: graphed_decoder.py)
        # One cast for the whole call (not one kernel per stream); the pieces are views.
        return list(torch.cat(wavs).float().split([w.numel() for w in wavs]))

    def _stream_state(self, stream_id: str) -> DecoderState:
        """A known stream's carried state, or a fresh one (decoder positions count from its first chunk)."""
        stream = self._streams.get(stream_id)
        return stream.state if stream is not None else self.decoder.init_state(1, self.device, self.dtype)


@contextmanager
def _threads(count: int) -> Iterator[None]:
    """The calling thread's torch intra-op threads set to ``count`` meanwhile (OpenMP's count is
    per calling thread: other threads keep theirs)."""
    before = torch.get_num_threads()
    if before != count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if before != count:
            torch.set_num_threads(before)
