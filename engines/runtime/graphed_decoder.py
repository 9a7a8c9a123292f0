"""The streaming codec decoder over a static state pool; one CUDA graph per (rows, chunk length).

``GraphedDecoder(decoder, max_streams, chunk_lengths)`` decodes the next chunk of many
streams at once, ``decode([(stream_id, codes [t, G], is_last), ...]) -> [wav [t * 1920]]``,
with every stream's :class:`~engines.models.codec_decoder.DecoderState` kept in a pool
instead of per-stream tensors. What a chunk computes is exactly ``CodecDecoder.decode_step``
(same modules, same math); only where the state lives and how the call is launched differ.

State pool. Every ``DecoderState`` tensor (conv contexts, attention key/value windows,
positions) is allocated ONCE with ``max_streams + 1`` rows; the last row is the scratch
row that padding rows read and write. A stream gets a row on its first non-empty chunk
(``acquire``: the row is zeroed, which is exactly ``decoder.init_state``), keeps it
across chunks and gives it back after its last chunk (``is_last``) or on ``release``
(cancel); rows are reused, lowest first. Running out of rows raises before anything runs.

Static inputs, per chunk length T: ``codes`` [max_rows, G, T] int64; shared by all
buckets: ``index`` [max_rows] int64 (pool row per batch row; padding rows point at the
scratch row). A bucket of R rows uses the first R rows of each (contiguous views). The
``data_ptr`` of every static input and every pool tensor is fixed for the wrapper's life.

One step of bucket (R, T), what a graph captures (:meth:`_step`)::

    state = pool.index_select(0, index[:R])        # gather the rows
    wav, new = decoder.decode_step(codes_T[:R], state)
    pool.index_copy_(0, index[:R], new)            # scatter the new state back
    return wav                                     # [R, T * 1920]

Chunk lengths: ``chunk_lengths`` (the engine passes the preset's first chunk, chunk and
longest planned chunk, see :func:`engines.runtime.graphed_dit.max_chunk_frames`) x row
buckets (1, 2, 4, ... up to ``max_streams``; ``for_config`` stops at 16, see
``FOR_CONFIG_MAX_BUCKET``). A stream's FINAL chunk of
t <= max(chunk_lengths) frames is padded at the end with code 0 to the smallest chunk
length >= t and its wav truncated to t * 1920 samples: every conv pads on the left only
and attention is causal, so appended frames cannot change earlier samples (a CPU test
proves it on the real decoder and shows it would catch a lookahead); the padded frames
do advance the row's state, which is dropped with the row. A NON-final chunk must keep
its state exact, so one whose length is not a chunk length runs eagerly on the same
pool rows (gather, ``decode_step``, scatter) - as does a final chunk longer than every
chunk length - with a one-time warning; ``fallback_calls`` counts those eager steps.
Batches above the largest row bucket are split into pieces of that bucket.

Output: fresh tensors - per stream a view of a per-piece copy of the static output -
so they stay valid after later calls (the vocalizer's ``.float()`` copies only in bf16).

CUDA: each (R, T) is captured once (warm-up on a side stream, then capture; all graphs
in one ``torch.cuda.graph_pool_handle()``), with ``index`` set to the scratch row so
warm-up never advances a real stream. A call is: device-to-device copies of the codes,
one pinned, non-blocking host->device copy of the row indices, ``replay()``, one copy
of the output rows - no host sync. The step itself reads nothing on the host:
``decode_step``'s control flow depends on shapes only, ``state.position`` stays a tensor,
and ``DecoderState.select`` (``torch.as_tensor``) is never used here.
CPU: exactly the same static path runs eagerly (what the CPU tests check).
"""

from __future__ import annotations

import heapq
import logging

import torch

from engines.hardware.devices import upload
from engines.models.codec_decoder import CodecDecoder, DecoderState
from engines.runtime.cuda_graphs import BucketedGraphs, GraphedWrapper, resolve_use_graphs, smallest_bucket
from engines.runtime.graphed_dit import default_row_buckets, max_chunk_frames

log = logging.getLogger("streamvox.graphed_decoder")

WARMUP_ITERS = 3  # eager runs on a side stream before each capture (cuDNN/cuBLAS/SDPA init, allocator)
# for_config's largest row bucket. Measured on an H100, base preset, bf16: a 25-frame chunk
# costs 23 ms eager vs 5 ms graphed at 1 stream, but ~22 ms either way at 8 streams (GPU
# bound), so big buckets buy nothing; with buckets up to 128 rows the graph pool reserved
# 45 GiB, with buckets up to 16 it reserved 6 GiB and 128 streams (split into 8 x 16) took
# 264 ms per call instead of 241 ms.
FOR_CONFIG_MAX_BUCKET = 16
# Extra graphed lengths for_config adds: any non-final chunk then decodes as graph replays
# (binary pieces below the first chunk; e.g. a 30-frame clause tail = 25 + 4 + 1).
FOR_CONFIG_SPLIT_LENGTHS = (1, 2, 4, 8)


def graph_length(chunk_lengths: tuple[int, ...], frames: int, final: bool) -> int | None:
    """The chunk length a chunk of ``frames`` runs at: itself when it is one of the (sorted)
    ``chunk_lengths``, the next one up for a final chunk (padded), None (eager) otherwise."""
    if frames in chunk_lengths:
        return frames
    if final:
        return next((t for t in chunk_lengths if t >= frames), None)
    return None


def chunk_pieces(chunk_lengths: tuple[int, ...], frames: int, final: bool) -> list[int]:
    """How a chunk of ``frames`` is decoded: one piece when it has a graph (padded if final);
    else consecutive pieces of graphed lengths, largest first (a final chunk's last piece
    padded) when they add up exactly; else one eager piece."""
    if frames == 0 or graph_length(chunk_lengths, frames, final) is not None:
        return [frames]
    parts, left = [], frames
    while left > 0 and graph_length(chunk_lengths, left, final) is None:
        piece = next((t for t in reversed(chunk_lengths) if t <= left), None)
        if piece is None:
            return [frames]  # no exact cut: eager, as a whole
        parts.append(piece)
        left -= piece
    return parts + ([left] if left else [])


def decoder_chunk_lengths(stream_cfg) -> tuple[int, ...]:
    """The chunk lengths ``GraphedDecoder.for_config`` graphs for a preset's stream config: its first
    chunk, chunk and longest planned chunk, and the split lengths."""
    return tuple(sorted({stream_cfg.first_chunk_frames, stream_cfg.chunk_frames, max_chunk_frames(stream_cfg),
                         *FOR_CONFIG_SPLIT_LENGTHS}))


class GraphedDecoder(GraphedWrapper):
    """Batched, stateful streaming decode over a static state pool; CUDA graphs on CUDA, the
    same static path eagerly on CPU."""

    def __init__(self, decoder: CodecDecoder, max_streams: int, chunk_lengths: tuple[int, ...],
                 row_buckets: tuple[int, ...] | None = None, use_graphs: bool | None = None,
                 warmup_iters: int = WARMUP_ITERS, split_lengths: tuple[int, ...] = ()):
        """``split_lengths``: extra graphed lengths (e.g. 1, 2, 4, 8) that a non-final chunk of
        another length is cut into — consecutive streaming steps equal one longer step — so
        it replays a few graphs instead of running eagerly (the DiT source's clause tails)."""
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        chunk_lengths = tuple(sorted({int(t) for t in (*chunk_lengths, *split_lengths)}))
        if not chunk_lengths or chunk_lengths[0] < 1:
            raise ValueError(f"chunk_lengths must be positive frame counts, got {chunk_lengths}")
        row_buckets = default_row_buckets(max_streams) if row_buckets is None else tuple(sorted({int(b) for b in row_buckets}))
        if not row_buckets or row_buckets[0] < 1 or row_buckets[-1] > max_streams:
            raise ValueError(f"row buckets must be in 1..max_streams={max_streams}, got {row_buckets}")
        param = next(decoder.parameters())
        self.decoder = decoder
        self.device, self.dtype = param.device, param.dtype
        use_graphs = resolve_use_graphs(use_graphs, self.device, "decoder")
        self.max_streams, self.chunk_lengths, self.row_buckets = max_streams, chunk_lengths, row_buckets
        self.scratch_row = max_streams
        self.num_code_groups = decoder.cfg.num_quantizers
        self.samples_per_frame = decoder.samples_per_frame
        dev, max_rows = self.device, row_buckets[-1]
        self.pool: DecoderState = decoder.init_state(max_streams + 1, dev, self.dtype)
        self._index = torch.full((max_rows,), self.scratch_row, dtype=torch.int64, device=dev)
        self._codes = {t: torch.zeros(max_rows, self.num_code_groups, t, dtype=torch.int64, device=dev)
                       for t in chunk_lengths}
        # One graph per (rows, T), all in one pool; warm-up and capture step only the scratch row.
        self.graphs = BucketedGraphs(self._step, dev, use_graphs, warmup_iters, before_capture=self._before_capture,
                                     name="codec decoder")
        self._rows: dict[str, int] = {}  # stream id -> pool row
        self._free = list(range(max_streams))  # a heap: the lowest free row first
        self.fallback_calls = 0  # eager steps (chunk lengths or shapes outside the graphed buckets)
        self._warned = False

    @classmethod
    def for_config(cls, decoder: CodecDecoder, model_cfg, max_streams: int, **kwargs) -> "GraphedDecoder":
        """Chunk lengths from a ModelConfig's stream: (first chunk, chunk, longest planned chunk);
        row buckets 1, 2, 4, ... up to min(max_streams, FOR_CONFIG_MAX_BUCKET) unless given
        (larger batches are split into pieces of the largest bucket)."""
        kwargs.setdefault("row_buckets", default_row_buckets(min(max_streams, FOR_CONFIG_MAX_BUCKET)))
        return cls(decoder, max_streams, decoder_chunk_lengths(model_cfg.stream), **kwargs)

    # ------------------------------------------------------------------ public API

    def open_streams(self) -> int:
        return len(self._rows)

    def row_of(self, stream_id: str) -> int | None:
        return self._rows.get(stream_id)

    def acquire(self, stream_id: str) -> int:
        """The stream's pool row; a new stream gets the lowest free row, reset to ``init_state``."""
        return self._acquire([stream_id])[0]

    def release(self, stream_id: str) -> None:
        """Give the stream's row back (last chunk decoded, or cancelled); unknown ids are ignored."""
        row = self._rows.pop(stream_id, None)
        if row is not None:
            heapq.heappush(self._free, row)

    def bucket_rows(self, rows: int) -> int | None:
        """The smallest row bucket holding ``rows``; None when it exceeds the largest."""
        return smallest_bucket(self.row_buckets, rows)

    def graph_length(self, frames: int, final: bool) -> int | None:
        """The chunk length a chunk of ``frames`` runs at (see :func:`graph_length`)."""
        return graph_length(self.chunk_lengths, frames, final)

    def pieces(self, frames: int, final: bool) -> list[int]:
        """How a chunk of ``frames`` is decoded (see :func:`chunk_pieces`)."""
        return chunk_pieces(self.chunk_lengths, frames, final)

    def static_pointers(self) -> dict[str, int]:
        """data_ptr of every static input and pool tensor (they must never change)."""
        out = {"index": self._index.data_ptr(), "position": self.pool.position.data_ptr()}
        out.update({f"codes{t}": c.data_ptr() for t, c in self._codes.items()})
        for name in ("conv", "keys", "values"):
            out.update({f"{name}{i}": x.data_ptr() for i, x in enumerate(getattr(self.pool, name))})
        return out

    @torch.no_grad()
    def capture_all(self) -> None:
        """Capture every (rows, chunk length) bucket now (engine start, before /readyz). CPU: no-op."""
        self.graphs.capture_all([(rows, t) for rows in self.row_buckets for t in self.chunk_lengths])

    @torch.no_grad()
    def decode(self, items: list[tuple[str, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """items: (stream_id, codes [t, G] integer on the decoder's device, is_last) -> wav [t * 1920]
        per item, in the decoder's dtype, same order. A chunk without a graph of its own is
        cut into graphed pieces (see ``pieces``) decoded one after the other."""
        expanded: list[tuple[str, torch.Tensor, bool]] = []
        spans: list[range] = []
        for sid, codes, is_last in items:
            start = len(expanded)
            parts = self.pieces(codes.shape[0], is_last) if codes.dim() == 2 else [codes.shape[0]]
            offset = 0
            for k, n in enumerate(parts):
                expanded.append((sid, codes[offset:offset + n], is_last and k == len(parts) - 1))
                offset += n
            spans.append(range(start, len(expanded)))
        if len(expanded) == len(items):
            return self._decode_pieces(items)
        wavs = self._decode_pieces(expanded)
        return [wavs[span[0]] if len(span) == 1 else torch.cat([wavs[j] for j in span]) for span in spans]

    def _decode_pieces(self, items: list[tuple[str, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """items: (stream_id, codes [t, G] integer on the decoder's device, is_last) -> wav [t * 1920]
        per item, in the decoder's dtype, same order.

        Items of one stream decode in order (round r holds every stream's r-th item). A
        stream's position is its pool row's (counted from its first chunk), so no frame
        offset is passed. Rows of streams with an ``is_last`` item are released at the end.
        Returned tensors never alias the static buffers (valid after later calls)."""
        G = self.num_code_groups
        for sid, codes, _ in items:
            if codes.dim() != 2 or codes.shape[1] != G or codes.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"stream {sid!r}: codes must be integer [t, {G}], got {codes.dtype} "
                                 f"{tuple(codes.shape)}")
        # Rows for new streams up front, so running out fails the call before any state changes.
        new = list(dict.fromkeys(sid for sid, c, _ in items if c.shape[0] > 0 and sid not in self._rows))
        if len(new) > len(self._free):
            raise RuntimeError(f"decoder state pool is full: {len(new)} new streams, {len(self._free)} free rows "
                               f"of max_streams={self.max_streams} ({len(self._rows)} open); release finished streams")
        self._acquire(new)
        wavs: list[torch.Tensor | None] = [None] * len(items)
        rounds: list[list[int]] = []
        seen: dict[str, int] = {}
        last_index: dict[str, int] = {}
        for i, (sid, _, _) in enumerate(items):
            r = seen.get(sid, 0)
            seen[sid] = r + 1
            last_index[sid] = i
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(i)
        for round_items in rounds:
            graphed: dict[int, list[int]] = {}
            eager: dict[int, list[int]] = {}
            for i in round_items:
                sid, codes, is_last = items[i]
                t = codes.shape[0]
                if t == 0:
                    wavs[i] = torch.empty(0, dtype=self.dtype, device=self.device)
                    continue
                # Padding is only safe for the stream's last chunk (its state is dropped after).
                T = self.graph_length(t, is_last and last_index[sid] == i)
                (graphed.setdefault(T, []) if T is not None else eager.setdefault(t, [])).append(i)
            for T, group in graphed.items():
                step = self.row_buckets[-1]
                for start in range(0, len(group), step):
                    self._run_graphed(items, group[start:start + step], T, wavs)
            for t, group in eager.items():
                self._run_eager(items, group, t, wavs)
        for sid, _, is_last in items:
            if is_last:
                self.release(sid)
        return wavs  # type: ignore[return-value]

    # ------------------------------------------------------------------ internals

    def _acquire(self, stream_ids: list[str]) -> list[int]:
        fresh = [sid for sid in dict.fromkeys(stream_ids) if sid not in self._rows]
        if len(fresh) > len(self._free):
            raise RuntimeError(f"decoder state pool is full ({self.max_streams} streams open); "
                               "release finished streams")
        new_rows = []
        for sid in fresh:
            self._rows[sid] = heapq.heappop(self._free)
            new_rows.append(self._rows[sid])
        if new_rows:  # a reused row must start like init_state (all zeros, position 0)
            idx = upload(new_rows, torch.int64, self.device)
            for x in self._state_tensors():
                x.index_fill_(0, idx, 0)
        return [self._rows[sid] for sid in stream_ids]

    def _state_tensors(self) -> list[torch.Tensor]:
        """Every pool tensor with data (a conv with no left context carries an empty one)."""
        p = self.pool
        return [x for x in (*p.conv, *p.keys, *p.values, p.position) if x.numel()]

    def _gather(self, idx: torch.Tensor) -> DecoderState:
        n = idx.shape[0]
        pick = lambda ts: [t.index_select(0, idx) if t.numel() else t[:n] for t in ts]  # noqa: E731
        p = self.pool
        return DecoderState(pick(p.conv), pick(p.keys), pick(p.values), p.position.index_select(0, idx))

    def _scatter(self, idx: torch.Tensor, new: DecoderState) -> None:
        p = self.pool
        for dst, src in zip((*p.conv, *p.keys, *p.values, p.position),
                            (*new.conv, *new.keys, *new.values, new.position)):
            if dst.numel():
                dst.index_copy_(0, idx, src)

    def _step(self, key: tuple[int, int]) -> torch.Tensor:
        """Bucket ``key`` = (rows, t) from its static inputs: gather, decode_step, scatter ->
        wav [rows, t * 1920]. Exactly what a CUDA graph captures."""
        rows, t = key
        idx = self._index[:rows]
        wav, new = self.decoder.decode_step(self._codes[t][:rows], self._gather(idx))
        self._scatter(idx, new)
        return wav

    def _load(self, items, group: list[int], rows: int, T: int) -> None:
        """Codes and pool rows of ``group`` into bucket (rows, T); padding: code 0, scratch row."""
        n = len(group)
        buf = self._codes[T]
        codes = [items[i][1].to(self.device) for i in group]
        if all(c.shape[0] == T for c in codes):
            buf[:n].copy_(torch.stack(codes).transpose(1, 2))
        else:
            for j, c in enumerate(codes):
                buf[j, :, : c.shape[0]].copy_(c.T)
                if c.shape[0] < T:
                    buf[j, :, c.shape[0]:].zero_()
        if n < rows:
            buf[n:rows].zero_()
        index = [self._rows[items[i][0]] for i in group] + [self.scratch_row] * (rows - n)
        if self.device.type == "cuda":
            self._index[:rows].copy_(torch.tensor(index, dtype=torch.int64).pin_memory(), non_blocking=True)
        else:
            self._index[:rows].copy_(torch.tensor(index, dtype=torch.int64))

    def _run_graphed(self, items, group: list[int], T: int, wavs: list) -> None:
        rows = self.bucket_rows(len(group))
        key = (rows, T)
        if self.use_graphs:
            self.graphs.ensure(key)  # before loading: warm-up and capture use the scratch row only
        self._load(items, group, rows, T)
        out = self.graphs.run(key)
        got = out[: len(group)].clone()  # the static output is overwritten by the next replay
        spf = self.samples_per_frame
        for j, i in enumerate(group):
            wavs[i] = got[j, : items[i][1].shape[0] * spf]

    def _run_eager(self, items, group: list[int], t: int, wavs: list) -> None:
        """decode_step on the pool rows without a graph (a length or shape no bucket holds)."""
        self.fallback_calls += 1
        if not self._warned:
            self._warned = True
            log.warning("decoder chunk of %d frames (%d streams) is outside the graphed chunk lengths %s: running "
                        "the eager decoder on the pool rows (warned once; fallback_calls counts them)",
                        t, len(group), self.chunk_lengths)
        idx = upload([self._rows[items[i][0]] for i in group], torch.int64, self.device)
        codes = torch.stack([items[i][1].to(self.device) for i in group]).transpose(1, 2)  # [n, G, t]
        wav, new = self.decoder.decode_step(codes, self._gather(idx))
        self._scatter(idx, new)
        for j, i in enumerate(group):
            wavs[i] = wav[j]

    def _before_capture(self, key: tuple[int, int]) -> None:
        """The index points at the scratch row, so the warm-up runs touch no stream's state."""
        self._index[: key[0]].fill_(self.scratch_row)
