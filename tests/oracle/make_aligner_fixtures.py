"""Write the forced-aligner parity fixtures with the OFFICIAL qwen-asr code (.venv-aligner).

    .venv-aligner/bin/python tests/oracle/make_aligner_fixtures.py tests/fixtures/aligner

Writes a tiny random checkpoint in the released layout (config.json, model.safetensors with
``thinker.`` keys, a Qwen2 byte-level BPE tokenizer with the aligner's special tokens,
preprocessor_config.json) built by the official classes, then aligns 24 kHz test audio with
``Qwen3ForcedAligner.align`` one item at a time (and one batch of equal-length items), and
records per case: the word list, the official times (seconds), and the logits the official
thinker returned (real positions only) in ``tiny.reference.safetensors``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from qwen_asr import Qwen3ForcedAligner
from qwen_asr.core.transformers_backend import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

SEED = 20260
CORPUS = [
    "Hello world, this is a small test of the streaming voice and its word timestamps.",
    "Grüße aus München! Schöne Straße, über Äpfel und Öl. Ça va? Très bien, merci.",
    "你好，世界。今天天气很好。我们一起说话，时间戳对齐。",
    "안녕하세요 세계 여러분 오늘은 좋은 날입니다",
    "東京に行きました。今日はいい天気です。",
    "Numbers like 2026 and 42; don't, it's, U.S.A. and e-mail.",
] * 8
ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
         "<timestamp>"]
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SR = 24_000
# (name, text, language, seconds at 24 kHz): a single short chunk, chunk + tail, several
# attention windows, each splitting rule.
CASES = [
    ("en_short", "Hello, world!", "English", 0.37),
    ("en_long", "It's a test of U.S. timing: 42 words, maybe more; don't stop.", "English", 9.53),
    ("de", "Grüße aus München, schöne Straße!", "German", 1.71),
    ("zh", "你好，世界。Hello 2026年", "Chinese", 2.4),
    ("ko", "안녕하세요 세계 여러분, 오늘은 좋은 날입니다.", "Korean", 2.05),
    ("ja", "東京に行きました。今日はいい天気です。", "Japanese", 1.5),
    ("fr", "Ça va? Très bien, merci.", "French", 1.5),
]
BATCH = ("ja", "fr")  # equal 16 kHz lengths, a multiple of the hop: the official batch equals its solo calls


def write_tokenizer(directory: Path) -> dict[str, int]:
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(directory))
    n = tok.get_vocab_size()
    ids = {content: n + i for i, content in enumerate(ADDED)}
    config = {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "unk_token": None,
        "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for c, i in ids.items()},
        "additional_special_tokens": ADDED[1:],
        "extra_special_tokens": {"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                                 "audio_eos_token": "<|audio_end|>"},
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return ids


def model_config(ids: dict[str, int]) -> Qwen3ASRConfig:
    audio = dict(num_mel_bins=128, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                 downsample_hidden_size=8, output_dim=32, max_source_positions=1500, n_window=50,
                 n_window_infer=800, conv_chunksize=500, activation_function="gelu")
    text = dict(vocab_size=max(ids.values()) + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1_000_000.0,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "interleaved": True},
                rms_norm_eps=1e-6, tie_word_embeddings=False)
    thinker = dict(model_type="qwen3_forced_aligner", audio_config=audio, text_config=text,
                   audio_token_id=ids["<|audio_pad|>"], audio_start_token_id=ids["<|audio_start|>"],
                   classify_num=500)
    return Qwen3ASRConfig(thinker_config=thinker, timestamp_token_id=ids["<timestamp>"],
                          timestamp_segment_time=80, support_languages=[c[2] for c in CASES])


@torch.no_grad()
def randomize(model: torch.nn.Module, g: torch.Generator) -> None:
    """Fan-in-scaled weights (activations stay O(1)), norms around 1, small biases."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            kind = type(module).__name__
            if isinstance(module, torch.nn.LayerNorm) or kind.endswith("RMSNorm"):
                value = (1.0 if name == "weight" else 0.0) + 0.1 * torch.randn(p.shape, generator=g)
            elif name == "bias":
                value = 0.1 * torch.randn(p.shape, generator=g)
            elif isinstance(module, torch.nn.Embedding):
                value = torch.randn(p.shape, generator=g)
            elif p.dim() >= 2:
                value = torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel())
            else:
                raise ValueError(f"no rule for {kind}.{name}")
            p.copy_(value)


def test_audio(seconds: float, seed: int) -> np.ndarray:
    """Speech-like 24 kHz audio: voiced harmonics with a moving pitch, bursts of noise, pauses."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * SR))) / SR
    pitch = 120 + 40 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6))
    phase = 2 * np.pi * np.cumsum(pitch) / SR
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = np.clip(np.sin(2 * np.pi * 2.3 * t + rng.uniform(0, 6)), 0, None)
    wav = 0.3 * voiced * envelope + 0.05 * rng.standard_normal(t.shape) * (1 - envelope)
    return wav.astype(np.float32)


def main(out: Path) -> None:
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    ckpt = out / "tiny"
    ids = write_tokenizer(ckpt)
    model = Qwen3ASRForConditionalGeneration(model_config(ids)).eval()
    randomize(model, g)
    with torch.no_grad():  # a quiet <timestamp> embedding: its class then follows the context, not the token
        model.thinker.model.embed_tokens.weight[ids["<timestamp>"]] *= 0.05
    model.save_pretrained(ckpt, safe_serialization=True)
    # save_pretrained writes the class's model_type; the aligner is told apart by the thinker's
    # ("forced_aligner" in it), as the released config.json says.
    config = json.loads((ckpt / "config.json").read_text())
    config["thinker_config"]["model_type"] = "qwen3_forced_aligner"
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor(feature_size=128).save_pretrained(ckpt)

    aligner = Qwen3ForcedAligner.from_pretrained(str(ckpt), dtype=torch.float32)
    assert aligner.model.thinker.lm_head.out_features == 500, "not loaded as the forced aligner"
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def keep(module, args, kwargs, output):
        captured.append((kwargs["input_ids"].clone(), kwargs["attention_mask"].clone(), output.logits.clone()))

    aligner.model.thinker.register_forward_hook(keep, with_kwargs=True)
    refs: dict[str, torch.Tensor] = {}
    manifest = {"checkpoint": "tiny", "sample_rate": SR, "cases": {}, "batch": {}}
    for i, (name, text, language, seconds) in enumerate(CASES):
        wav = test_audio(seconds, SEED + i)
        refs[f"{name}.audio"] = torch.from_numpy(wav)
        captured.clear()
        result = aligner.align(audio=(wav, SR), text=text, language=language)[0]
        input_ids, mask, logits = captured[0]
        real = mask[0].bool()
        refs[f"{name}.input_ids"] = input_ids[0][real]
        refs[f"{name}.logits"] = logits[0][real]
        stamp = logits[0][input_ids[0] == ids["<timestamp>"]]
        top2 = stamp.topk(2, dim=-1).values
        words, _ = aligner.aligner_processor.encode_timestamp(text, language)
        manifest["cases"][name] = {
            "text": text, "language": language, "words": words,
            "times_s": [[it.text, it.start_time, it.end_time] for it in result],
            "min_margin": float((top2[:, 0] - top2[:, 1]).min()),
        }
    batch = [(refs[f"{n}.audio"].numpy(), SR) for n in BATCH]
    texts = [manifest["cases"][n]["text"] for n in BATCH]
    langs = [manifest["cases"][n]["language"] for n in BATCH]
    results = aligner.align(audio=batch, text=texts, language=langs)
    manifest["batch"] = {n: [[it.text, it.start_time, it.end_time] for it in r] for n, r in zip(BATCH, results)}
    # The official repair of non-monotonic predictions, on random class sequences.
    rng = np.random.default_rng(SEED)
    repairs = []
    for n_words in (1, 2, 3, 5, 8, 13):
        for _ in range(6):
            classes = torch.from_numpy(rng.integers(0, 60, size=2 * n_words))
            data = (classes * aligner.timestamp_segment_time).numpy()
            repaired = aligner.aligner_processor.parse_timestamp([f"w{k}" for k in range(n_words)], data)
            repairs.append([classes.tolist(), [[it["start_time"], it["end_time"]] for it in repaired]])
    manifest["repairs"] = repairs
    save_file({k: v.contiguous() for k, v in refs.items()}, str(out / "tiny.reference.safetensors"))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
    print(f"aligner fixtures: {len(CASES)} cases, min margin "
          f"{min(c['min_margin'] for c in manifest['cases'].values()):.2e}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
