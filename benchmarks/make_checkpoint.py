"""Write a random Qwen3-TTS *CustomVoice* checkpoint at a released size, in the official
layout, for serving benchmarks (`streamvox serve --checkpoint DIR`).

Runs with the official code (the oracle: .venv-oracle, or the device's carried wheels):

    .venv-oracle/bin/python benchmarks/make_checkpoint.py --size 0.6b OUT_DIR
    .venv-oracle/bin/python benchmarks/make_checkpoint.py --size tiny OUT_DIR   # seconds, for a CPU check

The official ``Qwen3TTSForConditionalGeneration`` / ``Qwen3TTSTokenizerV2Model`` are built
from released-size configs (REFERENCES.md: talker 28 layers, hidden 1024 (0.6B) or 2048
(1.7B), predictor 5 x 1024, G = 16, codebook 2048, text vocabulary 151,936; decoder 8 x 512,
window 72, decoder_dim 1536), every talker and decoder parameter fan-in randomised, saved in
bf16 by ``save_pretrained``, with the test suite's small byte-level BPE as the text tokenizer
(its ids fit the released vocabulary). Step time does not depend on the weights' values;
the EOS row of the codec head is zero so utterances run to ``max_new_tokens``
(set by --max-new-tokens, written to generation_config.json) like a long sentence would.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "oracle"))

import official  # noqa: E402,F401  (stubs optional audio packages, pins transformers)
import torch  # noqa: E402
from make_fixtures import PREPROCESSOR_CONFIG  # noqa: E402
from make_talker_fixtures import write_text_tokenizer  # noqa: E402
from randomize import randomize_  # noqa: E402

SIZES = {  # talker hidden / intermediate / layers, text hidden, decoder preset
    "tiny": dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, predictor_hidden=64,
                 predictor_layers=2, predictor_heads=4, predictor_kv=2, codebook=64, groups=4, text_hidden=64,
                 text_vocab=1024, decoder="tiny"),
    "0.6b": dict(hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8, head_dim=128, predictor_hidden=1024,
                 predictor_layers=5, predictor_heads=16, predictor_kv=8, predictor_head_dim=128, codebook=2048, groups=16,
                 text_hidden=2048, text_vocab=151936, decoder="released"),
    "1.7b": dict(hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128, predictor_hidden=1024,
                 predictor_layers=5, predictor_heads=16, predictor_kv=8, predictor_head_dim=128, codebook=2048, groups=16,
                 text_hidden=2048, text_vocab=151936, decoder="released"),
}
DECODERS = {
    "tiny": dict(codebook_dim=32, hidden_size=32, latent_dim=32, num_attention_heads=4, num_key_value_heads=4,
                 head_dim=8, sliding_window=8, intermediate_size=64, num_hidden_layers=2, decoder_dim=32),
    "released": dict(codebook_dim=512, hidden_size=512, latent_dim=1024, num_attention_heads=16,
                     num_key_value_heads=16, head_dim=64, sliding_window=72, intermediate_size=1024,
                     num_hidden_layers=8, decoder_dim=1536),
}
SPEAKERS = ["vivian", "ryan", "serena", "dylan", "eric", "aiden"]


def model_config(s: dict, text_ids: dict[str, int]):
    cb = s["codebook"]
    special = cb  # special ids sit above the codebook (2048.. in the releases)
    talker = dict(
        code_predictor_config=dict(
            vocab_size=cb, hidden_size=s["predictor_hidden"], intermediate_size=3 * s["predictor_hidden"],
            num_hidden_layers=s["predictor_layers"], num_attention_heads=s["predictor_heads"],
            num_key_value_heads=s["predictor_kv"], head_dim=s.get("predictor_head_dim", s["predictor_hidden"] // s["predictor_heads"]),
            rms_norm_eps=1e-6, rope_theta=1_000_000, max_position_embeddings=65, num_code_groups=s["groups"]),
        vocab_size=cb + 1024, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], rope_theta=1_000_000, rms_norm_eps=1e-6, max_position_embeddings=32768,
        rope_scaling={"mrope_section": [s["head_dim"] // 2 - 2 * (s["head_dim"] * 5 // 32), s["head_dim"] * 5 // 32,
                                        s["head_dim"] * 5 // 32], "interleaved": True, "rope_type": "default"},
        num_code_groups=s["groups"], text_hidden_size=s["text_hidden"],
        text_vocab_size=max(s["text_vocab"], max(text_ids.values()) + 7),
        codec_pad_id=special + 100, codec_bos_id=special + 101, codec_eos_token_id=special + 102,
        codec_think_id=special + 106, codec_nothink_id=special + 107, codec_think_bos_id=special + 108,
        codec_think_eos_id=special + 109,
        codec_language_id={"chinese": special + 50, "english": special + 51, "german": special + 52},
        spk_id={name: special + 200 + i for i, name in enumerate(SPEAKERS)},
        spk_is_dialect={name: False for name in SPEAKERS})
    return official.Qwen3TTSConfig(
        talker_config=talker, speaker_encoder_config={}, tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size="bench", tts_model_type="custom_voice",
        im_start_token_id=text_ids["<|im_start|>"], im_end_token_id=text_ids["<|im_end|>"],
        tts_pad_token_id=text_ids["<tts_pad>"], tts_bos_token_id=text_ids["<tts_text_bos>"],
        tts_eos_token_id=text_ids["<tts_text_eod>"])


def tokenizer_config(s: dict):
    d = DECODERS[s["decoder"]]
    decoder = dict(codebook_size=s["codebook"], max_position_embeddings=8000, rope_theta=10000, attention_bias=False,
                   layer_scale_initial_scale=0.01, rms_norm_eps=1e-5, num_quantizers=s["groups"],
                   upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], **d)
    encoder = dict(hidden_size=32, num_filters=4, num_hidden_layers=1, intermediate_size=64, num_attention_heads=4,
                   num_key_value_heads=4, head_dim=8, codebook_size=s["codebook"], codebook_dim=32,
                   vector_quantization_hidden_dimension=32, num_quantizers=s["groups"], upsample_groups=32,
                   frame_rate=12.5, upsampling_ratios=[8, 6, 5, 4], sliding_window=16)
    return official.Qwen3TTSTokenizerV2Config(
        encoder_config=encoder, decoder_config=decoder, encoder_valid_num_quantizers=s["groups"],
        input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920, encode_downsample_rate=1920)


@torch.no_grad()
def write(size: str, directory: Path, max_new_tokens: int, seed: int = 0) -> None:
    s = SIZES[size]
    t0 = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    text_ids = write_text_tokenizer(directory)
    g = torch.Generator().manual_seed(seed)
    model = official.Qwen3TTSForConditionalGeneration(model_config(s, text_ids)).eval()
    randomize_(model.talker, g)
    eos = model.config.talker_config.codec_eos_token_id
    # EOS never wins, so utterances run to max_new_tokens: its logit is 0 while about half of the
    # code logits are positive (top-k keeps 50 of them; greedy takes the largest). Scaling the row
    # keeps its random sign: EOS then won within a few frames about half the time.
    model.talker.codec_head.weight[eos].zero_()
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())
    config.get("speaker_encoder_config", {}).pop("model_type", None)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (directory / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
         "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0, "subtalker_temperature": 0.9,
         "max_new_tokens": max_new_tokens}, indent=2))
    del model
    tokenizer = official.Qwen3TTSTokenizerV2Model(tokenizer_config(s)).eval()
    randomize_(tokenizer.decoder, g)
    st_dir = directory / "speech_tokenizer"
    tokenizer.to(torch.bfloat16).save_pretrained(st_dir, safe_serialization=True)
    (st_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    print(f"make_checkpoint: {size} -> {directory} in {time.monotonic() - t0:.1f} s", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="0.6b")
    ap.add_argument("--max-new-tokens", type=int, default=76,
                    help="frames per utterance + 1 (76: a 6 s sentence at 12.5 frames/s)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    write(args.size, args.out, args.max_new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
