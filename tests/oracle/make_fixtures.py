"""Write official-layout random Qwen3-TTS checkpoints + reference outputs.

Run inside .venv-oracle (scripts/oracle-env.sh does it):
    .venv-oracle/bin/python tests/oracle/make_fixtures.py tests/fixtures/oracle

For every config in CONFIGS it writes

    OUT/<name>/                      a Hugging Face-style Qwen3-TTS directory
        config.json, generation_config.json, model.safetensors   (talker.*, speaker_encoder.*)
        speech_tokenizer/config.json, preprocessor_config.json, model.safetensors (encoder.*, decoder.*)
    OUT/<name>.reference.safetensors reference outputs of the OFFICIAL code, computed
                                     with the model loaded back by the official
                                     from_pretrained (so the layout is proven too)
    OUT/manifest.json                what each config is and which cases it holds

Reference tensors (fp32):
    cp/<case>/inputs   [B, 2, H_talker]  code predictor prefill inputs
    cp/<case>/tokens   [B, G-1]          official generate(), greedy
    cp/<case>/logits   [B, G-1, V]       raw per-step logits of that generate()
    head/hidden        [B, H_talker]     talker last hidden (after its final norm)
    head/logits        [B, V_talker]     talker.codec_head(hidden)
    head/prenorm       [B, H_talker]     talker hidden before its final norm
    head/prenorm_logits                  talker.codec_head(talker.model.norm(prenorm))
    dec/<case>/codes   [B, G, T]         decoder input
    dec/<case>/wav     [B, T*1920]       official decoder full decode (clamped to +-1)
    dec/<case>/wav64   [B, T*1920]       the same in float64 (weights upcast), free of fp32 noise
    pipe/latents       [T, H_talker]     unit-RMS frame latents (talker hidden before its final norm)
    pipe/codes         [T, G]            greedy codes from the official head + generate()
    pipe/wav           [T*1920]          official decoder on those codes
The "dep" cases change one thing of a base case (code-0 embedding row, last
codebook) so the tests can show the oracle outputs depend on their inputs.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import official  # noqa: E402  (stubs optional audio packages, pins transformers)
from randomize import randomize_  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

SAMPLES_PER_FRAME = 1920
MIN_TOP2_MARGIN = 1e-4  # greedy decisions closer than this could flip at fp32 noise
# Decoder residual branches at this fraction of their input's RMS (see calibrate_output_scale_):
# 0.3 -> worst fp32 parity error ~7e-6, 0.2 -> ~4e-6, 0.1 -> ~3.7e-6 (fp32 rounding floor).
RESIDUAL_BRANCH_GAIN = 0.2


@dataclass(frozen=True)
class FixtureConfig:
    name: str
    talker_hidden: int
    predictor_hidden: int
    num_code_groups: int  # G (= decoder num_quantizers)
    codebook_size: int
    sliding_window: int  # decoder attention window, in frames
    decode_frames: int  # T of the decoder references (> sliding_window)
    tts_model_type: str = "base"  # "base" ships a speaker encoder (tolerated by our loader)
    seed: int = 0
    cp_cases: tuple[tuple[int, int], ...] = ((0, 1), (1, 3), (2, 8))  # (seed, batch)
    weight_dtypes: tuple[str, ...] = ()  # extra copies of the same weights in these dtypes


CONFIGS = [
    # talker hidden != predictor hidden: a real small_to_mtp_projection; G = 16 as released.
    FixtureConfig("g16_proj", talker_hidden=48, predictor_hidden=32, num_code_groups=16, codebook_size=64,
                  sliding_window=4, decode_frames=12, tts_model_type="base", seed=1),
    # equal hiddens: identity projection; another G; also saved as bf16 and fp16 weights.
    FixtureConfig("g8_ident", talker_hidden=32, predictor_hidden=32, num_code_groups=8, codebook_size=128,
                  sliding_window=6, decode_frames=14, tts_model_type="custom_voice", seed=2,
                  weight_dtypes=("bfloat16", "float16")),
]


def talker_config(fc: FixtureConfig) -> dict:
    cb = fc.codebook_size
    special = cb + 16  # special codec ids above the codebook, like 2148.. above 2048
    return dict(
        code_predictor_config=dict(
            vocab_size=cb, hidden_size=fc.predictor_hidden, intermediate_size=2 * fc.predictor_hidden,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=fc.predictor_hidden // 4,
            rms_norm_eps=1e-6, rope_theta=1_000_000, max_position_embeddings=64, num_code_groups=fc.num_code_groups,
        ),
        vocab_size=cb + 32, hidden_size=fc.talker_hidden, intermediate_size=2 * fc.talker_hidden,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_theta=1_000_000, rms_norm_eps=1e-6, max_position_embeddings=256,
        rope_scaling={"mrope_section": [2, 3, 3], "interleaved": True, "rope_type": "default"},
        num_code_groups=fc.num_code_groups, text_hidden_size=32, text_vocab_size=64,
        codec_pad_id=special + 4, codec_bos_id=special + 5, codec_eos_token_id=special + 6,
        codec_think_id=special + 10, codec_nothink_id=special + 11,
        codec_think_bos_id=special + 12, codec_think_eos_id=special + 13,
        spk_id={"ryan": special + 1}, spk_is_dialect={"ryan": False}, codec_language_id={"english": special + 2},
    )


def model_config(fc: FixtureConfig):
    return official.Qwen3TTSConfig(
        talker_config=talker_config(fc),
        speaker_encoder_config=dict(mel_dim=128, enc_dim=fc.talker_hidden, enc_channels=[32, 32, 32, 32, 96],
                                    enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
                                    enc_attention_channels=16, enc_res2net_scale=4, enc_se_channels=16),
        tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="tiny", tts_model_type=fc.tts_model_type,
        im_start_token_id=60, im_end_token_id=61, tts_pad_token_id=62, tts_bos_token_id=63, tts_eos_token_id=59,
    )


def tokenizer_config(fc: FixtureConfig):
    decoder = dict(
        codebook_size=fc.codebook_size, codebook_dim=32, hidden_size=32, latent_dim=32, max_position_embeddings=512,
        rope_theta=10000, num_attention_heads=4, num_key_value_heads=4, head_dim=8, attention_bias=False,
        sliding_window=fc.sliding_window, intermediate_size=64, layer_scale_initial_scale=0.01, rms_norm_eps=1e-5,
        num_hidden_layers=2, num_quantizers=fc.num_code_groups, upsample_rates=[8, 5, 4, 3],
        upsampling_ratios=[2, 2], decoder_dim=32,
    )
    # A tiny Mimi encoder: only there because real directories hold one (we ignore it).
    encoder = dict(hidden_size=32, num_filters=4, num_hidden_layers=1, intermediate_size=64,
                   num_attention_heads=4, num_key_value_heads=4, head_dim=8, codebook_size=fc.codebook_size,
                   codebook_dim=32, vector_quantization_hidden_dimension=32, num_quantizers=fc.num_code_groups,
                   upsample_groups=32, frame_rate=12.5, upsampling_ratios=[8, 6, 5, 4], sliding_window=16)
    return official.Qwen3TTSTokenizerV2Config(
        encoder_config=encoder, decoder_config=decoder, encoder_valid_num_quantizers=fc.num_code_groups,
        input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920, encode_downsample_rate=1920,
    )


GENERATION_CONFIG = {  # the released files' sampling defaults (REFERENCES.md)
    "do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
    "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0, "subtalker_temperature": 0.9,
    "max_new_tokens": 8192,
}
PREPROCESSOR_CONFIG = {
    "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "padding_side": "right",
    "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": 24000,
}


def build_random(fc: FixtureConfig):
    """Official modules from config, with the compared parts fan-in randomised."""
    g = torch.Generator().manual_seed(1000 + fc.seed)
    model = official.Qwen3TTSForConditionalGeneration(model_config(fc)).eval()
    talker = model.talker
    for part in (talker.code_predictor, talker.codec_head, talker.model.norm, talker.model.codec_embedding):
        randomize_(part, g)
    tokenizer = official.Qwen3TTSTokenizerV2Model(tokenizer_config(fc)).eval()
    randomize_(tokenizer.decoder, g)
    calibrate_output_scale_(tokenizer.decoder, fc, g)
    return model, tokenizer


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean().sqrt()


@torch.no_grad()
def calibrate_output_scale_(decoder, fc: FixtureConfig, g: torch.Generator) -> None:
    """Keep the decoder's activations O(1) and its audio at RMS ~ 0.25.

    With plain fan-in init the residual units add up and activations reach ~1e2-1e3
    before the last SnakeBeta, where sin(alpha * x) of such x carries fp32 rounding
    of ~|x| * 6e-8: the official fp32 decode then differs from its own fp64 decode
    by ~2e-4, and no fp32 comparison can hold 1e-5. Trained decoders stay O(1), so
    each upsampling block's transposed conv is rescaled to unit-RMS output on a
    probe batch (a linear map: exact), and the last conv so random codes give audio
    of RMS ~ 0.25 (well under 1 % clipped: saturated samples equal +-1 on both sides
    and would hide differences).
    """
    codes = torch.randint(0, fc.codebook_size, (2, fc.num_code_groups, 8), generator=g)
    hidden = decoder.pre_conv(decoder.quantizer.decode(codes)).transpose(1, 2)
    hidden = decoder.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
    for blocks in decoder.upsample:
        for block in blocks:
            hidden = block(hidden)
    hidden = decoder.decoder[0](hidden)
    for block in decoder.decoder[1:-2]:  # SnakeBeta, transposed conv, 3 residual units
        hidden = block.block[0](hidden)
        up = block.block[1]
        hidden = up(hidden)
        scale = 1.0 / _rms(hidden)
        up.conv.weight.mul_(scale)
        up.conv.bias.mul_(scale)
        hidden = hidden * scale
        for unit in block.block[2:]:  # residual branch at RESIDUAL_BRANCH_GAIN x its input's RMS
            branch = unit.conv2(unit.act2(unit.conv1(unit.act1(hidden))))
            scale = RESIDUAL_BRANCH_GAIN * _rms(hidden) / _rms(branch)
            unit.conv2.conv.weight.mul_(scale)
            unit.conv2.conv.bias.mul_(scale)
            hidden = hidden + branch * scale
    last_conv = decoder.decoder[-1].conv
    hidden = decoder.decoder[-1](decoder.decoder[-2](hidden))
    scale = 0.25 / _rms(hidden)
    last_conv.weight.mul_(scale)
    last_conv.bias.mul_(scale)


def save_checkpoint(model, tokenizer, directory: Path, dtype: torch.dtype) -> None:
    # Casting in place and back would round the fp32 weights: restore them afterwards.
    fp32_model = {k: v.clone() for k, v in model.state_dict().items()}
    fp32_tokenizer = {k: v.clone() for k, v in tokenizer.state_dict().items()}
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    # The speaker-encoder config class skips PretrainedConfig.__init__, so to_dict()
    # adds a "model_type" its own __init__ rejects on load; released files lack it.
    config = json.loads((directory / "config.json").read_text())
    config["speaker_encoder_config"].pop("model_type", None)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    st_dir = directory / "speech_tokenizer"
    tokenizer.to(dtype).save_pretrained(st_dir, safe_serialization=True)
    (st_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    model.to(torch.float32).load_state_dict(fp32_model)
    tokenizer.to(torch.float32).load_state_dict(fp32_tokenizer)


def load_official(directory: Path):
    """The official load path (weights upcast to fp32 for the references)."""
    model = official.Qwen3TTSForConditionalGeneration.from_pretrained(
        str(directory), dtype=torch.float32, local_files_only=True, attn_implementation="sdpa")
    return model.eval()


def assert_loaded_back(expected: dict, loaded: dict, what: str) -> None:
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise AssertionError(f"{what}: official from_pretrained lost tensors {missing[:5]}")
    for key, value in expected.items():
        if not torch.equal(loaded[key].to(value.dtype), value):
            raise AssertionError(f"{what}: official from_pretrained changed tensor {key}")


@torch.no_grad()
def code_predictor_refs(talker, fc: FixtureConfig, cases, refs: dict) -> None:
    predictor = talker.code_predictor
    steps = fc.num_code_groups - 1
    for seed, batch in cases:
        g = torch.Generator().manual_seed(seed)
        inputs = torch.randn(batch, 2, fc.talker_hidden, generator=g)
        out = predictor.generate(inputs_embeds=inputs, max_new_tokens=steps, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences
        logits = torch.stack(out.logits, dim=1)  # [B, G-1, V]
        assert tokens.shape == (batch, steps), tokens.shape
        assert torch.equal(logits.argmax(-1), tokens), "greedy tokens must be the argmax of the raw logits"
        top2 = logits.topk(2, dim=-1).values
        margin = (top2[..., 0] - top2[..., 1]).min().item()
        if margin < MIN_TOP2_MARGIN:
            raise AssertionError(f"{fc.name} cp seed {seed}: near-tie ({margin:.2e}); pick another seed")
        case = f"cp/s{seed}_b{batch}"
        refs[f"{case}/inputs"], refs[f"{case}/tokens"], refs[f"{case}/logits"] = inputs, tokens, logits
    # Dependence: only the code-0 embedding row of the first case changes.
    seed, batch = cases[-1]
    inputs = refs[f"cp/s{seed}_b{batch}/inputs"].clone()
    inputs[:, 1] = torch.randn(batch, fc.talker_hidden, generator=torch.Generator().manual_seed(99))
    out = predictor.generate(inputs_embeds=inputs, max_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    refs["cp/dep/inputs"], refs["cp/dep/tokens"] = inputs, out.sequences
    refs["cp/dep/logits"] = torch.stack(out.logits, dim=1)


@torch.no_grad()
def codec_head_refs(talker, fc: FixtureConfig, refs: dict) -> None:
    g = torch.Generator().manual_seed(7)
    prenorm = 3.0 * torch.randn(5, fc.talker_hidden, generator=g)  # any scale: the norm removes it
    hidden = talker.model.norm(prenorm)
    refs["head/prenorm"] = prenorm
    refs["head/prenorm_logits"] = talker.codec_head(hidden)
    refs["head/hidden"] = torch.randn(5, fc.talker_hidden, generator=g)
    refs["head/logits"] = talker.codec_head(refs["head/hidden"])


@torch.no_grad()
def decoder_refs(decoder, fc: FixtureConfig, refs: dict) -> None:
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, fc.codebook_size, (2, fc.num_code_groups, fc.decode_frames), generator=g)
    dep = codes.clone()
    dep[:, -1] = torch.randint(0, fc.codebook_size, dep[:, -1].shape, generator=g)  # last codebook only
    decoder64 = copy.deepcopy(decoder).double()  # fp64: the implementation check free of fp32 noise
    for case, c in (("full", codes), ("dep", dep)):
        wav = decoder(c).squeeze(1)
        refs[f"dec/{case}/wav64"] = decoder64(c).squeeze(1)
        assert wav.shape == (2, fc.decode_frames * SAMPLES_PER_FRAME), wav.shape
        clipped = (wav.abs() >= 1.0).float().mean().item()
        if clipped >= 0.01:
            raise AssertionError(f"{fc.name} decoder {case}: {clipped:.2%} of samples clipped")
        refs[f"dec/{case}/codes"] = c
        refs[f"dec/{case}/wav"] = wav


@torch.no_grad()
def pipeline_refs(model, fc: FixtureConfig, refs: dict) -> None:
    """Frame latents -> codes -> audio through the official modules, greedy: what
    streamvox's vocalizer computes from unit-RMS latents (the talker hidden before its
    final norm). Code 0 is the argmax over codebook ids only (special ids masked)."""
    talker, decoder = model.talker, model.speech_tokenizer.model.decoder
    g = torch.Generator().manual_seed(23)
    x = torch.randn(fc.decode_frames, fc.talker_hidden, generator=g)
    latents = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # unit RMS per frame
    hidden = talker.model.norm(latents)
    code0_logits = talker.codec_head(hidden)[:, :fc.codebook_size]
    top2 = code0_logits.topk(2, dim=-1).values
    if (top2[:, 0] - top2[:, 1]).min().item() < MIN_TOP2_MARGIN:
        raise AssertionError(f"{fc.name} pipeline: near-tie in code 0; pick another seed")
    code0 = code0_logits.argmax(-1)
    prefill = torch.stack([hidden, talker.model.codec_embedding(code0)], dim=1)  # [T, 2, D]: one frame per row
    rest = talker.code_predictor.generate(inputs_embeds=prefill, max_new_tokens=fc.num_code_groups - 1,
                                          do_sample=False, return_dict_in_generate=True).sequences
    codes = torch.cat([code0[:, None], rest], dim=1)  # [T, G]
    refs["pipe/latents"], refs["pipe/codes"] = latents, codes
    refs["pipe/wav"] = decoder(codes.T[None]).reshape(-1)


def write_references(model, fc: FixtureConfig, cases, path: Path) -> dict:
    refs: dict[str, torch.Tensor] = {}
    code_predictor_refs(model.talker, fc, cases, refs)
    codec_head_refs(model.talker, fc, refs)
    decoder_refs(model.speech_tokenizer.model.decoder, fc, refs)
    pipeline_refs(model, fc, refs)
    save_file({k: v.contiguous() for k, v in refs.items()}, str(path))
    return refs


def main(out: Path) -> None:
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"qwen_tts": "0.1.1", "transformers": official.transformers.__version__,
                "torch": torch.__version__, "stubbed_modules": official.STUBBED, "checkpoints": {}}
    for fc in CONFIGS:
        t0 = time.time()
        model, tokenizer = build_random(fc)
        expected_talker = {k: v.clone() for k, v in model.state_dict().items()}
        expected_decoder = {f"decoder.{k}": v.clone() for k, v in tokenizer.decoder.state_dict().items()}
        variants = [("float32", fc.name)] + [(d, f"{fc.name}_{d}") for d in fc.weight_dtypes]
        for dtype_name, name in variants:
            dtype = getattr(torch, dtype_name)
            directory = out / name
            save_checkpoint(model, tokenizer, directory, dtype)
            loaded = load_official(directory)
            # The official load path must give back exactly what we saved (after the dtype round trip).
            round_trip = {k: v.to(dtype).to(torch.float32) for k, v in expected_talker.items()}
            assert_loaded_back(round_trip, loaded.state_dict(), f"{name}/model.safetensors")
            st_state = load_file(str(directory / "speech_tokenizer" / "model.safetensors"))
            assert all(st_state[k].dtype == dtype for k in expected_decoder), f"{name}: decoder dtype"
            assert_loaded_back({k: v.to(dtype).to(torch.float32) for k, v in expected_decoder.items()},
                               {f"decoder.{k}": v for k, v in
                                loaded.speech_tokenizer.model.decoder.state_dict().items()},
                               f"{name}/speech_tokenizer/model.safetensors")
            cases = fc.cp_cases if dtype_name == "float32" else fc.cp_cases[:1]
            refs = write_references(loaded, fc, cases, out / f"{name}.reference.safetensors")
            manifest["checkpoints"][name] = {
                "weight_dtype": dtype_name, "talker_hidden": fc.talker_hidden,
                "predictor_hidden": fc.predictor_hidden, "num_code_groups": fc.num_code_groups,
                "codebook_size": fc.codebook_size, "sliding_window": fc.sliding_window,
                "decode_frames": fc.decode_frames, "tts_model_type": fc.tts_model_type,
                "cp_cases": [f"s{s}_b{b}" for s, b in cases],
                "reference_keys": sorted(refs),
            }
        print(f"make_fixtures: {fc.name} (+{len(variants) - 1} dtype variants) in {time.time() - t0:.1f}s",
              flush=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: make_fixtures.py OUT_DIR")
    main(Path(sys.argv[1]))
