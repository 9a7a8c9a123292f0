"""Talker-side parts the vocalizer needs: final norm, codec head, codec embedding.

State-dict keys equal the official ones under ``talker.``: ``model.norm.weight``,
``codec_head.weight``, ``model.codec_embedding.weight``.

Input is a unit-RMS frame latent u (talker hidden before its final norm divided by
its RMS). The talker's post-norm hidden is h = RMSNorm(u) = w * u (up to eps); that h
feeds the codec head (code 0) and the code predictor's prefill.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.models.configs import CodecHeadConfig
from engines.models.layers import RMSNorm
from engines.models.sampling import DOMAIN_CODE0, FrameSampling, sample_rows


class _TalkerModelParts(nn.Module):
    """Container so the parameter names read ``model.norm`` / ``model.codec_embedding``."""

    def __init__(self, cfg: CodecHeadConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class CodecHead(nn.Module):
    def __init__(self, cfg: CodecHeadConfig):
        super().__init__()
        if not 0 < cfg.codebook_size <= cfg.vocab_size:
            raise ValueError(f"codebook_size {cfg.codebook_size} must be in (0, vocab_size={cfg.vocab_size}]")
        self.cfg = cfg
        self.model = _TalkerModelParts(cfg)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def hidden(self, u: torch.Tensor) -> torch.Tensor:
        """u [B, D] unit-RMS latents -> h [B, D], the talker hidden after its final norm."""
        if u.dim() != 2 or u.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"expected latents [B, {self.cfg.hidden_size}], got {tuple(u.shape)}")
        return self.model.norm(u)

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, D] (post-norm) -> logits [B, V_talker] over the full codec vocabulary."""
        return self.codec_head(h)

    def logits(self, u: torch.Tensor) -> torch.Tensor:
        """u [B, D] -> logits [B, V_talker]."""
        return self.logits_from_hidden(self.hidden(u))

    def sample_code0(self, logits: torch.Tensor, sampling: FrameSampling) -> torch.Tensor:
        """logits [B, V_talker] -> code 0 [B]; special ids (>= codebook_size) can never win."""
        masked = logits.float().masked_fill(
            torch.arange(logits.shape[-1], device=logits.device) >= self.cfg.codebook_size, float("-inf"))
        return sample_rows(masked, sampling, DOMAIN_CODE0, sampling.frame)

    def embed(self, code0: torch.Tensor) -> torch.Tensor:
        """code 0 [B] -> talker codec embedding [B, D] (the predictor's second prefill input)."""
        return self.model.codec_embedding(code0)
