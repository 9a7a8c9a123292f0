"""Write official-layout random Qwen3-TTS *Base*, *VoiceDesign* and 1.7B-style *CustomVoice*
checkpoints plus reference outputs of the official voice-clone / voice-design / instruction
paths (qwen-tts 0.1.1).

Run inside .venv-oracle (scripts/oracle-clone-fixtures.sh does it):
    .venv-oracle/bin/python tests/oracle/make_clone_fixtures.py tests/fixtures/oracle/clone

Per checkpoint directory OUT/<name>/ (the released layout, text tokenizer included) and
OUT/<name>.reference.safetensors:

    filterbank              librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)
    ref/<r>/wav             [N] float32 reference audio at 24 kHz (Base only)
    ref/<r>/mel             [T, 128] the official mel_spectrogram of it (extract_speaker_embedding's input)
    ref/<r>/xvector         [D] model.extract_speaker_embedding
    ref/<r>/codes           [ceil(N / 1920), G] speech_tokenizer.encode(...).audio_codes
    case/<c>/codes          [T, G] greedy codes of generate_voice_clone / generate_voice_design /
                            generate_custom_voice (do_sample=False, subtalker_dosample=False)
    case/<c>/wav            what the official call returned (in-context: the reference part cut off)
    case/<c>/prefill        [S, D] the talker's prefill inputs_embeds

Randomisation: tests/oracle/randomize.py for every parameter of the talker, speaker encoder and
speech-tokenizer encoder; the Mimi codebooks (buffers) are drawn from the spread of the encoder's
own outputs so reference codes vary. Greedy decisions and codeword choices closer than
MIN_MARGIN would make the comparison flaky at fp32 noise: the script fails instead.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import official  # noqa: E402  (pins transformers; librosa is installed for this script)
from make_fixtures import PREPROCESSOR_CONFIG, calibrate_output_scale_, tokenizer_config  # noqa: E402
from make_talker_fixtures import (  # noqa: E402
    MIN_MARGIN,
    StepRecorder,
    TalkerFixture,
    decoder_fixture,
    generation_config,
    model_config,
    processed_margin,
    write_text_tokenizer,
)
from qwen_tts.core.models import modeling_qwen3_tts  # noqa: E402
from qwen_tts.inference.qwen3_tts_model import Qwen3TTSModel  # noqa: E402
from randomize import randomize_  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


@dataclass(frozen=True)
class CloneFixture:
    talker: TalkerFixture
    tts_model_type: str  # base | voice_design | custom_voice
    tts_model_size: str  # "0b6" makes the official wrapper drop instructions
    quantizers: int = 0  # Base: the Mimi encoder's total quantizers (> G: only G are valid)
    vq_dim: int = 0  # Base: the quantizer's hidden size (!= 32: a real input_proj)


CONFIGS = [
    CloneFixture(TalkerFixture("base", talker_hidden=48, predictor_hidden=32, num_code_groups=8, codebook_size=64,
                               text_hidden=40, layers=2, max_new_tokens=24, eos_gain=1.6, seed=31),
                 "base", "0b6", quantizers=12, vq_dim=16),
    CloneFixture(TalkerFixture("design", talker_hidden=32, predictor_hidden=32, num_code_groups=4, codebook_size=64,
                               text_hidden=24, layers=2, max_new_tokens=20, eos_gain=1.4, seed=32),
                 "voice_design", "1b7"),
    CloneFixture(TalkerFixture("cv17", talker_hidden=32, predictor_hidden=32, num_code_groups=4, codebook_size=64,
                               text_hidden=24, layers=2, max_new_tokens=20, eos_gain=1.4, seed=33),
                 "custom_voice", "1b7"),
]

REF_TEXT = "Hello world, this is a test."
TEXTS = ["Streaming speech, 2026 camelCase!", "Hi.",
         "The talker predicts one frame at a time, then the code predictor fills the rest of it."]
INSTRUCT = "Speak slowly and warmly, like a calm narrator."
# Reference audios: (name, seconds, seed). 1.7 s -> 22 frames (text shorter than the codec part
# of the in-context prompt); 1.2 s -> 15 frames, used with the long text (text longer).
REFS = [("a", 1.7, 1), ("b", 1.2, 2)]
# (case, kind, text index, language, non_streaming_mode or None (the call's default), ref, x_vector_only, speaker)
CASES = {
    "base": [
        ("icl_a_stream", "clone", 0, "English", None, "a", False, None),
        ("icl_a_nonstream", "clone", 0, "Auto", True, "a", False, None),
        ("icl_b_stream_long", "clone", 2, "Auto", False, "b", False, None),
        ("icl_b_nonstream_long", "clone", 2, "English", True, "b", False, None),
        ("xvec_a_stream", "clone", 1, "English", None, "a", True, None),
        ("xvec_b_nonstream", "clone", 0, "Auto", True, "b", True, None),
    ],
    "design": [
        ("design_en", "design", 0, "English", None, None, False, None),
        ("design_auto_stream", "design", 1, "Auto", False, None, False, None),
    ],
    "cv17": [
        ("instruct_ryan_en", "custom", 0, "English", None, None, False, "Ryan"),
        ("instruct_dylan_auto_stream", "custom", 1, "Auto", False, None, False, "Dylan"),
    ],
}


def reference_audio(seconds: float, seed: int) -> np.ndarray:
    """A voiced-like test signal: a gliding harmonic tone with an envelope, plus noise."""
    g = np.random.default_rng(seed)
    n = int(round(seconds * 24000))
    t = np.arange(n) / 24000
    f0 = 110 + 60 * seed + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / 24000
    wav = sum(0.3 / k * np.sin(k * phase) for k in range(1, 6))
    wav = wav * (0.6 + 0.4 * np.sin(2 * np.pi * 2.3 * t)) + 0.02 * g.standard_normal(n)
    return (0.8 * wav / np.abs(wav).max()).astype(np.float32)


def speech_tokenizer(cf: CloneFixture):
    config = tokenizer_config(decoder_fixture(cf.talker))
    if cf.quantizers:
        enc = config.encoder_config
        enc.num_quantizers = cf.quantizers
        enc.vector_quantization_hidden_dimension = cf.vq_dim
        enc.codebook_dim = cf.vq_dim
        config.encoder_config = enc
    return official.Qwen3TTSTokenizerV2Model(config).eval()


@torch.no_grad()
def randomize_encoder_(encoder, probe: torch.Tensor, g: torch.Generator) -> None:
    """Every Mimi parameter, then codebooks spread like the vectors they quantise."""
    randomize_(encoder, g)
    x = encoder.encoder(probe[:, None])
    x = encoder.encoder_transformer(x.transpose(1, 2)).last_hidden_state.transpose(1, 2)
    x = encoder.downsample(x)
    for rvq in (encoder.quantizer.semantic_residual_vector_quantizer,
                encoder.quantizer.acoustic_residual_vector_quantizer):
        v = rvq.input_proj(x) if rvq.input_proj is not None else x
        scale = v.std().item()
        for i, layer in enumerate(rvq.layers):
            book = layer.codebook
            usage = 0.5 + 1.5 * torch.rand(book.cluster_usage.shape, generator=g)
            book.cluster_usage.copy_(usage)
            book.embed_sum.copy_(scale * 0.7 ** i * torch.randn(book.embed_sum.shape, generator=g) * usage[:, None])
            book._embed = None


def build_and_save(cf: CloneFixture, directory: Path) -> None:
    fc = cf.talker
    text_ids = write_text_tokenizer(directory)
    g = torch.Generator().manual_seed(7000 + fc.seed)
    config = model_config(fc, text_ids)
    config.tts_model_type = cf.tts_model_type
    config.tts_model_size = cf.tts_model_size
    model = official.Qwen3TTSForConditionalGeneration(config).eval()
    randomize_(model.talker, g)
    with torch.no_grad():
        eos = model.config.talker_config.codec_eos_token_id
        model.talker.codec_head.weight[eos] *= fc.eos_gain
    if model.speaker_encoder is not None:
        randomize_(model.speaker_encoder, g)
    tokenizer = speech_tokenizer(cf)
    randomize_(tokenizer.decoder, g)
    calibrate_output_scale_(tokenizer.decoder, decoder_fixture(fc), g)
    if cf.tts_model_type == "base":
        probe = torch.from_numpy(np.stack([reference_audio(1.0, 9), reference_audio(1.0, 10)]))
        randomize_encoder_(tokenizer.encoder, probe, g)

    model.save_pretrained(directory, safe_serialization=True)
    saved = json.loads((directory / "config.json").read_text())
    saved["speaker_encoder_config"].pop("model_type", None)  # see make_fixtures.save_checkpoint
    (directory / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True))
    (directory / "generation_config.json").write_text(json.dumps(generation_config(fc), indent=2))
    st_dir = directory / "speech_tokenizer"
    tokenizer.save_pretrained(st_dir, safe_serialization=True)
    (st_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))


def codeword_margin(encoder, wav: np.ndarray, count: int) -> float:
    """Smallest relative gap between the nearest and second-nearest codeword of every choice."""
    x = torch.from_numpy(wav)[None, None]
    with torch.no_grad():
        x = encoder.encoder(x)
        x = encoder.encoder_transformer(x.transpose(1, 2)).last_hidden_state.transpose(1, 2)
        x = encoder.downsample(x)
        margin = float("inf")
        q = encoder.quantizer
        for rvq, n in ((q.semantic_residual_vector_quantizer, 1), (q.acoustic_residual_vector_quantizer, count - 1)):
            residual = (rvq.input_proj(x) if rvq.input_proj is not None else x)[0].T
            for layer in rvq.layers[:n]:
                d = torch.cdist(residual[None], layer.codebook.embed[None])[0]
                top2 = d.topk(2, largest=False).values
                margin = min(margin, ((top2[:, 1] - top2[:, 0]) / top2[:, 1]).min().item())
                residual = residual - layer.codebook.embed[d.argmin(-1)]
    return margin


def run_case(tts: Qwen3TTSModel, fc: TalkerFixture, case, refs_audio: dict, refs: dict) -> dict:
    name, kind, text_i, language, non_streaming, ref, xvec_only, speaker = case
    rec = StepRecorder(tts.model.talker)
    captured = []
    original_generate = tts.model.generate

    def generate_and_keep(*args, **kwargs):  # instrumentation only: keep what generate() returned
        result = original_generate(*args, **kwargs)
        captured.append(result)
        return result

    tts.model.generate = generate_and_keep
    kw = dict(do_sample=False, subtalker_dosample=False)
    if non_streaming is not None:
        kw["non_streaming_mode"] = non_streaming
    try:
        if kind == "clone":
            wavs, sr = tts.generate_voice_clone(TEXTS[text_i], language=language, ref_audio=(refs_audio[ref], 24000),
                                                ref_text=REF_TEXT, x_vector_only_mode=xvec_only, **kw)
        elif kind == "design":
            wavs, sr = tts.generate_voice_design(TEXTS[text_i], instruct=INSTRUCT, language=language, **kw)
        else:
            wavs, sr = tts.generate_custom_voice(TEXTS[text_i], speaker=speaker, language=language,
                                                 instruct=INSTRUCT, **kw)
    finally:
        rec.close()
        del tts.model.generate
    assert sr == 24000
    cfg = tts.model.config.talker_config
    codes = captured[0][0][0].detach().clone().long()
    logits = torch.stack(rec.talker_logits)
    penalty = tts.generate_defaults.get("repetition_penalty", 1.05)
    replay = logits.argmax(-1).tolist()  # only for the margin: processed_margin re-applies the processors
    replay = codes[:, 0].tolist() + replay[codes.shape[0]:]
    margin = processed_margin(logits, replay, cfg, penalty)
    pred = torch.stack(rec.predictor_logits) if rec.predictor_logits else None
    pmargin = 1.0
    if pred is not None:
        top2 = pred.topk(2, dim=-1).values
        pmargin = (top2[:, 0] - top2[:, 1]).min().item()
    if min(margin, pmargin) < MIN_MARGIN:
        raise AssertionError(f"{fc.name}/{name}: near-tie in greedy decoding (talker {margin:.2e}, "
                             f"predictor {pmargin:.2e}); change the config seed")
    refs[f"case/{name}/codes"] = codes
    refs[f"case/{name}/wav"] = torch.from_numpy(np.asarray(wavs[0], dtype=np.float32))
    refs[f"case/{name}/prefill"] = rec.prefill
    frames = codes.shape[0]
    return {"kind": kind, "text": TEXTS[text_i], "language": language, "non_streaming_mode": non_streaming,
            "ref": ref, "ref_text": REF_TEXT if kind == "clone" else None, "x_vector_only_mode": xvec_only,
            "speaker": speaker, "instruct": INSTRUCT if kind != "clone" else None, "frames": frames,
            "talker_margin": margin, "predictor_margin": pmargin}


def main(out: Path) -> None:
    import librosa

    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"qwen_tts": "0.1.1", "transformers": official.transformers.__version__, "torch": torch.__version__,
                "librosa": librosa.__version__, "checkpoints": {}}
    for cf in CONFIGS:
        fc = cf.talker
        t0 = time.time()
        directory = out / fc.name
        build_and_save(cf, directory)
        tts = Qwen3TTSModel.from_pretrained(str(directory), dtype=torch.float32, local_files_only=True,
                                            attn_implementation="sdpa")
        tts.model.eval()
        refs: dict[str, torch.Tensor] = {
            "filterbank": torch.from_numpy(librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000))}
        audio = {}
        info = {"tts_model_type": cf.tts_model_type, "tts_model_size": cf.tts_model_size,
                "num_code_groups": fc.num_code_groups, "refs": {}}
        if cf.tts_model_type == "base":
            encoder = tts.model.speech_tokenizer.model.encoder
            for ref, seconds, seed in REFS:
                wav = reference_audio(seconds, seed)
                audio[ref] = wav
                mel = modeling_qwen3_tts.mel_spectrogram(torch.from_numpy(wav)[None], n_fft=1024, num_mels=128,
                                                         sampling_rate=24000, hop_size=256, win_size=1024, fmin=0,
                                                         fmax=12000).transpose(1, 2)[0]
                codes = tts.model.speech_tokenizer.encode(wav, sr=24000).audio_codes[0]
                margin = codeword_margin(encoder, wav, fc.num_code_groups)
                if margin < MIN_MARGIN:
                    raise AssertionError(f"{fc.name}/ref {ref}: near-tie between codewords ({margin:.2e})")
                refs[f"ref/{ref}/wav"] = torch.from_numpy(wav)
                refs[f"ref/{ref}/mel"] = mel.contiguous()
                refs[f"ref/{ref}/xvector"] = tts.model.extract_speaker_embedding(wav, 24000).float()
                refs[f"ref/{ref}/codes"] = codes.long()
                info["refs"][ref] = {"seconds": seconds, "frames": int(codes.shape[0]), "codeword_margin": margin,
                                     "distinct_code0": len(set(codes[:, 0].tolist()))}
        cases = {c[0]: run_case(tts, fc, c, audio, refs) for c in CASES[fc.name]}
        info["cases"] = cases
        save_file({k: v.contiguous() for k, v in refs.items()}, str(out / f"{fc.name}.reference.safetensors"))
        manifest["checkpoints"][fc.name] = info
        print(f"make_clone_fixtures: {fc.name} in {time.time() - t0:.1f}s: "
              f"{ {k: v['frames'] for k, v in cases.items()} } refs={info['refs']}", flush=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: make_clone_fixtures.py OUT_DIR")
    main(Path(sys.argv[1]))
