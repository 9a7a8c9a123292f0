"""Qwen3-ForcedAligner: audio + transcript -> one timestamp class per ``<timestamp>`` token.

Plain-torch port of the ``thinker`` of ``qwen_asr``'s ``Qwen3ASRForConditionalGeneration``
in its forced-aligner form (``lm_head`` is a ``classify_num``-way timestamp classifier, not
the vocabulary). State-dict keys equal the official ones under ``thinker.``:

    audio_tower.conv2d{1,2,3}.{weight,bias}, audio_tower.conv_out.weight,
    audio_tower.layers.{i}.self_attn.{q,k,v,out}_proj.{weight,bias},
    audio_tower.layers.{i}.{self_attn_layer_norm,final_layer_norm}.{weight,bias},
    audio_tower.layers.{i}.fc{1,2}.{weight,bias}, audio_tower.{ln_post,proj1,proj2}.*
    model.embed_tokens.weight, model.layers.{i}.* (Qwen3 layers), model.norm.weight, lm_head.weight

One forward, no generation: the audio encoder turns each item's log-mel frames into
audio embeddings (``encode_audio``), they replace the ``<|audio_pad|>`` embeddings, and
the causal Qwen3 decoder + classifier score every position (``classify``). Class ``c`` at a
``<timestamp>`` token means ``c * timestamp_segment_time`` ms.

The audio encoder, as the official one: mel frames are cut into chunks of
``2 * n_window`` frames, each chunk goes through three stride-2 convs on its own (with
sinusoidal positions restarting per chunk), then self-attention runs inside windows of
``n_window_infer / (2 * n_window)`` chunks. The official loop encodes items one by one;
here every chunk and window of a batch runs at once (windows padded, padding masked), which
is the same maths. Text positions are plain 0..S-1 (the official M-RoPE gets three equal
position ids, which is numerically the 1-D rotation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engines.models.configs import FromDict, Qwen3LayerConfig
from engines.models.layers import DecoderLayer, RMSNorm, attend, key_padding_mask, rope_cos_sin, rope_inv_freq


@dataclass(frozen=True)
class AudioEncoderConfig(FromDict):
    """Keys of ``thinker_config.audio_config`` that the encoder needs."""

    num_mel_bins: int = 128
    d_model: int = 1024
    encoder_layers: int = 24
    encoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    downsample_hidden_size: int = 480
    output_dim: int = 1024
    max_source_positions: int = 1500
    n_window: int = 50
    n_window_infer: int = 800


@dataclass(frozen=True)
class TextDecoderConfig(Qwen3LayerConfig):
    """Keys of ``thinker_config.text_config`` (the Qwen3 decoder)."""

    vocab_size: int = 151936


@dataclass(frozen=True)
class ForcedAlignerConfig:
    audio: AudioEncoderConfig
    text: TextDecoderConfig
    classify_num: int = 5000
    audio_token_id: int = 151646
    timestamp_token_id: int = 151705
    timestamp_segment_time: float = 80.0  # ms per timestamp class


def cnn_output_length(frames: torch.Tensor | int, n_window: int = 50) -> torch.Tensor | int:
    """Audio tokens out of ``frames`` mel frames: full ``2 * n_window`` chunks give 13 each,
    the tail chunk three halvings (the official ``_get_feat_extract_output_lengths``, which
    hard-codes 100-frame chunks and 13 tokens per chunk)."""
    tail = frames % 100
    after = (tail - 1) // 2 + 1
    return ((after - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13


def sinusoids(length: int, channels: int, max_timescale: float = 10_000.0) -> torch.Tensor:
    """Whisper's sinusoidal positions [length, channels] (sin half, then cos half)."""
    log_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class AudioAttention(nn.Module):
    """Bidirectional multi-head attention with biases (``q/k/v/out_proj``) over padded windows."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(attend(q, k, v, mask, self.head_dim**-0.5))


class AudioEncoderLayer(nn.Module):
    """Pre-LayerNorm transformer layer with a GELU MLP (``fc1``/``fc2``)."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn = AudioAttention(cfg.d_model, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """Log-mel frames -> audio embeddings of the decoder's width (``output_dim``).

    ``windowed_attention``: attend within windows of ``n_window_infer`` frames, as the
    official code does under flash-attention 2 and in its vLLM backend (the default here);
    False: across the whole item, as its transformers code does with SDPA or eager attention
    (it passes no mask then). The two differ only for items longer than one window (8 s).
    """

    windowed_attention: bool = True

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        ch = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        freq = (((cfg.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2
        self.conv_out = nn.Linear(ch * freq, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.register_buffer("positional_embedding", sinusoids(cfg.max_source_positions, cfg.d_model),
                             persistent=False)

    def _plan(self, frames: list[int]):
        """Per item: chunk lengths in mel frames, and attention-window lengths in tokens."""
        chunk = 2 * self.cfg.n_window
        chunks, windows = [], []
        for n in frames:
            lens = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
            tokens = [int(cnn_output_length(x)) for x in lens]
            total = int(cnn_output_length(n))
            # The official window: the item's longest chunk output times chunks per window.
            window = max(tokens) * (self.cfg.n_window_infer // chunk) if self.windowed_attention else total
            windows.append([window] * (total // window) + ([total % window] if total % window else []))
            chunks.append(lens)
        return chunks, windows

    def _convs(self, width: int, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Chunks [mel, n <= width], zero-padded to ``width`` -> their valid tokens [t(n), d_model]."""
        padded = pieces[0].new_zeros(len(pieces), 1, pieces[0].shape[0], width)
        for i, p in enumerate(pieces):
            padded[i, 0, :, :p.shape[-1]] = p
        x = F.gelu(self.conv2d1(padded))
        x = F.gelu(self.conv2d2(x))
        x = F.gelu(self.conv2d3(x))
        c, ch, freq, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(c, t, ch * freq))
        x = x + self.positional_embedding[:t].to(x.dtype)
        return [x[i, :int(cnn_output_length(p.shape[-1]))] for i, p in enumerate(pieces)]

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """features: per item [num_mel_bins, T_i] -> per item [cnn_output_length(T_i), output_dim]."""
        chunk_lens, window_lens = self._plan([f.shape[-1] for f in features])
        # The official code zero-pads an item's chunks to its longest chunk before the convs,
        # and the padding leaks into the last valid outputs (gelu(bias) != 0 after the first
        # conv): chunks are padded exactly so, grouped by that length.
        groups: dict[int, list[tuple[int, torch.Tensor]]] = {}
        order = 0
        for f, lens in zip(features, chunk_lens):
            for piece in f.split(lens, dim=-1):
                groups.setdefault(max(lens), []).append((order, piece))
                order += 1
        tokens_of: list[torch.Tensor | None] = [None] * order
        for width, members in groups.items():
            for (i, piece), out in zip(members, self._convs(width, [p for _, p in members])):
                tokens_of[i] = out
        tokens = torch.cat(tokens_of)  # every item's audio tokens, in order

        flat = [w for ws in window_lens for w in ws]
        windows = nn.utils.rnn.pad_sequence(list(tokens.split(flat)), batch_first=True)  # [W, Lmax, D]
        real = torch.arange(windows.shape[1], device=windows.device)[None, :] < torch.tensor(
            flat, device=windows.device)[:, None]
        mask = key_padding_mask(real)
        for layer in self.layers:
            windows = layer(windows, mask)
        out = self.proj2(F.gelu(self.proj1(self.ln_post(windows[real]))))
        return list(out.split([sum(ws) for ws in window_lens]))


class TextDecoder(nn.Module):
    """The Qwen3 decoder (``embed_tokens``, ``layers``, ``norm``) without a cache: one
    causal pass over right-padded rows (padding sits after every real token, so causal
    attention alone keeps it out of real positions)."""

    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        b, s, _ = embeds.shape
        positions = torch.arange(s, device=embeds.device)[None].expand(b, s)
        cos, sin = rope_cos_sin(self.inv_freq, positions, embeds.dtype)
        causal = torch.ones(s, s, dtype=torch.bool, device=embeds.device).tril()[None, None]
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, causal)
        return self.norm(x)


class ForcedAligner(nn.Module):
    """The thinker: ``audio_tower`` + ``model`` (decoder) + ``lm_head`` (timestamp classes)."""

    def __init__(self, cfg: ForcedAlignerConfig):
        super().__init__()
        self.cfg = cfg
        self.audio_tower = AudioEncoder(cfg.audio)
        self.model = TextDecoder(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.classify_num, bias=False)

    def hidden(self, input_ids: torch.Tensor, features: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [B, S] (right-padded, ``<|audio_pad|>`` runs sized by :func:`cnn_output_length`),
        features: per row [num_mel_bins, T] -> final hidden states [B, S, hidden]."""
        embeds = self.model.embed_tokens(input_ids)
        audio = torch.cat(self.audio_tower([f.to(embeds.dtype) for f in features]))
        slots = input_ids == self.cfg.audio_token_id
        if int(slots.sum()) != audio.shape[0]:
            raise ValueError(f"{int(slots.sum())} audio slots in the ids for {audio.shape[0]} audio embeddings")
        embeds = embeds.masked_scatter(slots[..., None], audio.to(embeds.dtype))
        return self.model(embeds)

    def forward(self, input_ids: torch.Tensor, features: list[torch.Tensor]) -> torch.Tensor:
        """Logits [B, S, classify_num] at every position (what the official ``thinker`` returns)."""
        return self.lm_head(self.hidden(input_ids, features))

    def timestamp_classes(self, input_ids: torch.Tensor, features: list[torch.Tensor]) -> torch.Tensor:
        """Argmax class at each ``<timestamp>`` position, rows concatenated in order [N]
        (the classifier runs on those positions only)."""
        hidden = self.hidden(input_ids, features)
        return self.lm_head(hidden[input_ids == self.cfg.timestamp_token_id]).argmax(-1)


__all__ = ["AudioEncoder", "AudioEncoderConfig", "ForcedAligner", "ForcedAlignerConfig", "TextDecoder",
           "TextDecoderConfig", "cnn_output_length", "sinusoids"]
