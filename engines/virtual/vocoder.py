"""The codec decoder on the virtual device: the real :class:`~engines.pipelines.vocoder.Vocalizer`
(validation, stream bookkeeping, priming) over a decoder that queues each call's cost instead of
running it, and returns silence of the right length.

The calls are the ones ``GraphedDecoder`` (engines/runtime/graphed_decoder.py) makes for the same
items: every chunk cut into graphed pieces, round r holding each stream's r-th piece, one call
per (chunk length, up to the largest rows bucket) group, at the smallest rows bucket that holds it.
"""

from __future__ import annotations

import torch

from engines.pipelines.vocoder import Vocalizer, _Stream
from engines.runtime.cuda_graphs import smallest_bucket
from engines.runtime.graphed_decoder import FOR_CONFIG_MAX_BUCKET, chunk_pieces, decoder_chunk_lengths, graph_length
from engines.runtime.graphed_dit import default_row_buckets
from engines.virtual.clock import DeviceClock
from engines.virtual.costs import CostTable
from engines.virtual.graphs import VirtualGraphs


class VirtualCodecDecoder:
    """What ``Vocalizer`` asks of a graphed decoder (``decode``, ``release``, ``capture_all``)."""

    def __init__(self, table: CostTable, clock: DeviceClock, stream_cfg, max_streams: int, samples_per_frame: int):
        self.decoder = None  # (the Vocalizer's, which it never runs)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.table = table
        self.clock = clock
        self.samples_per_frame = samples_per_frame
        self.chunk_lengths = decoder_chunk_lengths(stream_cfg)
        self.row_buckets = default_row_buckets(min(max_streams, FOR_CONFIG_MAX_BUCKET))
        self.graphs = VirtualGraphs("codec decoder", clock, table.capture_ms.codec_decode,
                                    [(rows, t) for rows in self.row_buckets for t in self.chunk_lengths])
        self.calls = 0
        self.fallback_calls = 0  # pieces with no graphed length (the real decoder runs them eagerly)
        # Silence is views of one zero buffer: fresh megabytes per call would cost this CPU page
        # faults and copies that the GPU's host never spends (its PCM lives on the device).
        self._silence = torch.zeros(0)

    def capture_all(self) -> None:
        self.graphs.capture_all()

    @property
    def late_captures(self) -> int:
        """Graphs captured after start (what the engine's capture metric sums)."""
        return self.graphs.late_captures

    def release(self, stream_id: str) -> None:
        """Nothing to free: no state pool."""

    def decode(self, items: list[tuple[str, torch.Tensor, bool]]) -> list[torch.Tensor]:
        """Silence [t * samples_per_frame] per item; the calls' costs go onto the clock."""
        pieces: list[tuple[str, int, bool]] = []
        for sid, codes, is_last in items:
            parts = chunk_pieces(self.chunk_lengths, codes.shape[0], is_last)
            pieces += [(sid, n, is_last and k == len(parts) - 1) for k, n in enumerate(parts)]
        last_index = {sid: i for i, (sid, _, _) in enumerate(pieces)}
        rounds: list[list[int]] = []
        seen: dict[str, int] = {}
        for i, (sid, _, _) in enumerate(pieces):
            r = seen.get(sid, 0)
            seen[sid] = r + 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(i)
        for round_items in rounds:
            groups: dict[int, int] = {}
            for i in round_items:
                sid, t, is_last = pieces[i]
                if t == 0:
                    continue
                length = graph_length(self.chunk_lengths, t, is_last and last_index[sid] == i)
                if length is None:
                    self.fallback_calls += 1
                    length = t
                groups[length] = groups.get(length, 0) + 1
            for length, n in groups.items():
                step = self.row_buckets[-1]
                for start in range(0, n, step):
                    rows = smallest_bucket(self.row_buckets, min(step, n - start))
                    self.graphs.ensure((rows, length))
                    self.clock.graphed(self.table.codec_decode_ms(rows, length))
                    self.calls += 1
        return [self.silence(codes.shape[0] * self.samples_per_frame) for _, codes, _ in items]

    def silence(self, samples: int) -> torch.Tensor:
        if self._silence.numel() < samples:
            self._silence = torch.zeros(max(samples, 2 * self._silence.numel()))
        return self._silence[:samples]


class VirtualVocalizer(Vocalizer):
    """The real vocalizer's host side over :class:`VirtualCodecDecoder` (no codec decoder is built)."""

    def __init__(self, decoder: VirtualCodecDecoder, num_code_groups: int, codebook_size: int):
        # Vocalizer.__init__ builds a real decoder; only the attributes its host side reads are set here.
        self.device, self.dtype = decoder.device, decoder.dtype
        self.decoder = None
        self.num_code_groups, self.codebook_size = num_code_groups, codebook_size
        self.samples_per_frame = decoder.samples_per_frame
        self.windowed = False  # the graphed path, as on the GPU it stands for
        self._streams = {}
        self._graphed_decoder = decoder

    def _decode_graphed(self, items, codes):
        """The decoder's silence as it is (the real path's one cast over all pieces is device work)."""
        wavs = self._graphed_decoder.decode([(it.stream_id, c, it.is_last) for it, c in zip(items, codes)])
        for it, c in zip(items, codes):
            if c.shape[0]:
                self._streams[it.stream_id] = _Stream(None, it.frame_offset + c.shape[0])
        return wavs


__all__ = ["VirtualCodecDecoder", "VirtualVocalizer"]
