"""Parity of exported graphs with the torch modules they came from (``streamvox export
--check``, benchmarks, tests), and the example DiT batch they run on.

Apart from the backends so that they never import the ``engines.export`` facade back.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engines.export import make_decoder_runner, make_dit_runner
from engines.export.manifest import Manifest
from engines.models.configs import DiTConfig


def example_dit_batch(cfg: DiTConfig, positive_rows: int = 3, frames: int = 12, enc_len: int = 9,
                      context: int = 2, generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """A fused-CFG DiT batch like the tick loop builds: n positive rows then the same n rows
    against padded null states; ragged frames and encoder lengths (padding masked)."""
    n, g = positive_rows, generator
    D, C = cfg.latent_dim, cfg.cond_dim
    x = torch.randn(n, frames, D, generator=g).repeat(2, 1, 1)
    frame_len = [max(context + 1, frames - i) for i in range(n)] * 2
    frame_mask = torch.arange(frames)[None] < torch.tensor(frame_len)[:, None]
    x = x * frame_mask[..., None]  # padding rows are zeros in the scheduler's layout
    positions = (torch.arange(frames)[None] + torch.arange(n).repeat(2)[:, None] * 37) * frame_mask
    context_mask = (torch.arange(frames)[None] < context) & frame_mask
    t = torch.rand(n, generator=g).repeat(2)
    enc_pos = torch.randn(n, enc_len, C, generator=g)
    enc_null = torch.randn(1, 1, C, generator=g).expand(n, enc_len, C)
    enc_mask = (torch.arange(enc_len)[None] < torch.tensor([max(1, enc_len - 2 * i) for i in range(n)])[:, None])
    enc = torch.cat([enc_pos, enc_null]) * enc_mask.repeat(2, 1)[..., None]
    return x, positions, context_mask, frame_mask, t, enc, enc_mask.repeat(2, 1)


@torch.no_grad()
def parity_report(models, directory: str | Path) -> dict[str, float]:
    """Max |onnxruntime - torch| for a fused-CFG DiT batch, a full decode and a chunked
    streaming decode (vs the torch full decode) on random inputs, fp32 models on CPU."""
    graphs = Manifest.load(directory).graphs
    report = {}
    if "dit" in graphs:
        dit = make_dit_runner(models.dit, "onnxruntime", directory, "cpu")
        batch = example_dit_batch(models.dit.cfg)
        real = batch[3]  # padded frames carry no meaning
        report["dit (fused CFG batch)"] = (dit(*batch) - models.dit(*batch))[real].abs().max().item()
    if "decoder_step" not in graphs:
        return report
    dec = make_decoder_runner(models.decoder, "onnxruntime", directory, "cpu")
    codes = torch.randint(0, models.decoder.cfg.codebook_size, (2, models.decoder.cfg.num_quantizers, 30))
    full = models.decoder(codes)
    if "decoder_full" in graphs:
        report["decoder_full"] = (dec(codes) - full).abs().max().item()
    state, pieces = dec.init_state(2), []
    for a, b in ((0, 4), (4, 17), (17, 30)):
        wav, state = dec.decode_step(codes[..., a:b], state)
        pieces.append(wav)
    report["decoder_step chunks vs full"] = (torch.cat(pieces, 1) - full).abs().max().item()
    return report
