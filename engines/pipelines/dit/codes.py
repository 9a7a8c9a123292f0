"""Finished DiT latents -> code frames: codec head (code 0) and code predictor (codes 1..G-1).

The DiT pipeline owns these two models, so what leaves it is code frames like any other
pipeline's. One call codes every chunk finished in a tick as one batch (pieces of at most
``max_batch_rows``); sampling is keyed by (seed, global frame, group), so a stream's codes
do not depend on its batch neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from engines.hardware.devices import canonical_device
from engines.models.code_predictor import CodePredictor
from engines.models.codec_head import CodecHead
from engines.models.sampling import FrameSampling


@dataclass(frozen=True)
class LatentChunk:
    """One finished chunk of one stream: latents [T, D] and its sampling keys."""

    latents: torch.Tensor
    frame_offset: int  # global index of latents[0] in the utterance (sampling counters)
    seed: int
    greedy: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0


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


class FrameCoder:
    """Codec head + code predictor, batched over every chunk given to one call.

    ``predictor_graphs``: what runs the predictor, picked by the adapter from the device
    (engines/runtime/graphed_predictor.py ``GraphedCodePredictor`` on CUDA), called once with the
    predictor on its device; None: eager."""

    def __init__(self, head: CodecHead, predictor: CodePredictor, device, dtype: torch.dtype = torch.float32,
                 max_batch_rows: int = 512, predictor_graphs: Callable[[CodePredictor], Any] | None = None):
        hc, pc = head.cfg, predictor.cfg
        if hc.hidden_size != pc.talker_hidden_size:
            raise ValueError(f"codec head width {hc.hidden_size} != predictor talker_hidden_size {pc.talker_hidden_size}")
        if hc.codebook_size != pc.vocab_size:
            raise ValueError(f"codebook sizes differ: head {hc.codebook_size}, predictor {pc.vocab_size}")
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.device, self.dtype, self.max_batch_rows = canonical_device(device), dtype, max_batch_rows
        self.head = head.to(self.device, dtype).eval()
        predictor = predictor.to(self.device, dtype).eval()
        self.predictor = predictor_graphs(predictor) if predictor_graphs is not None else predictor
        self.latent_dim, self.num_code_groups = hc.hidden_size, pc.num_code_groups

    @torch.no_grad()
    def codes(self, chunks: list[LatentChunk]) -> list[torch.Tensor]:
        """codes [T_i, G] int64 per chunk, in order; all frames go through the models as one batch."""
        for c in chunks:
            lat = c.latents
            if lat.dim() != 2 or lat.shape[1] != self.latent_dim or not lat.is_floating_point():
                raise ValueError(f"latents must be floating point [T, {self.latent_dim}], got {lat.dtype} "
                                 f"{tuple(lat.shape)}")
            if not c.greedy and c.temperature <= 0:
                raise ValueError(f"temperature must be > 0, got {c.temperature}")
            if not 0 < c.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1], got {c.top_p}")
        lengths = [c.latents.shape[0] for c in chunks]
        out = [torch.empty(0, self.num_code_groups, dtype=torch.int64, device=self.device) for _ in chunks]
        active = [i for i, n in enumerate(lengths) if n > 0]
        if not active:
            return out
        latents = torch.cat([chunks[i].latents.to(self.device, self.dtype) for i in active])  # [N, D]
        sampling = FrameSampling.for_streams([(lengths[i], chunks[i].seed, chunks[i].frame_offset, chunks[i].greedy,
                                               chunks[i].temperature, chunks[i].top_k, chunks[i].top_p)
                                              for i in active], self.device)
        pieces = []
        for start in range(0, latents.shape[0], self.max_batch_rows):
            sl = slice(start, start + self.max_batch_rows)
            pieces.append(frame_codes(self.head, self.predictor, latents[sl], sampling.rows(sl)))
        for i, c in zip(active, torch.cat(pieces).split([lengths[i] for i in active])):
            out[i] = c
        return out
