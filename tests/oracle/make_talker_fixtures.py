"""Write official-layout random Qwen3-TTS *custom-voice* checkpoints (with their text
tokenizer files) plus reference outputs of the official ``generate_custom_voice``.

Run inside .venv-oracle (scripts/oracle-talker-fixtures.sh does it):
    .venv-oracle/bin/python tests/oracle/make_talker_fixtures.py tests/fixtures/oracle/talker

For every config in CONFIGS it writes

    OUT/<name>/                  a Hugging Face-style Qwen3-TTS directory, loaded back by
                                 the official Qwen3TTSModel.from_pretrained (model, processor,
                                 speech tokenizer, generation config):
        config.json, generation_config.json, model.safetensors (talker.*),
        vocab.json, merges.txt, tokenizer_config.json   (byte-level BPE, Qwen2 style,
                                 no tokenizer.json, as the releases ship it)
        speech_tokenizer/...
    OUT/<name>.reference.safetensors
        tok/<i>              token ids of TOKENIZER_TEXTS[i] by the official processor
        case/<c>/codes       [T, G] greedy codes of generate_custom_voice (do_sample=False,
                             subtalker_dosample=False; the checkpoint's repetition penalty,
                             min_new_tokens and suppressed ids in force)
        case/<c>/wav         [T * 1920] the waveform generate_custom_voice returned
        case/<c>/prefill     [S, D] the talker's prefill inputs_embeds
        case/<c>/logits      [T + 1, V] raw talker codec-head logits of every step
    OUT/manifest.json        configs, cases (text, speaker, language, mode, max_new_tokens)

Randomisation: every talker parameter fan-in scaled (tests/oracle/randomize.py), so the
codes depend on the text, speaker and language (the tests check that cases differ).
Greedy decisions closer than MIN_MARGIN (after the official logits processors) would
make the comparison flaky at fp32 noise: the script fails instead of writing them.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import official  # noqa: E402,F401  (stubs optional audio packages, pins transformers)
from make_fixtures import (  # noqa: E402
    PREPROCESSOR_CONFIG,
    FixtureConfig,
    calibrate_output_scale_,
    tokenizer_config,
)
from qwen_tts.inference.qwen3_tts_model import Qwen3TTSModel  # noqa: E402
from randomize import randomize_  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

MIN_MARGIN = 1e-4

# --------------------------------------------------------------------------- text tokenizer

# The Qwen2 pre-tokenizer split (transformers' Qwen2Converter / PRETOKENIZE_REGEX).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
CORPUS = [
    "<|im_start|>assistant\nHello world, this is a small test of the streaming voice.<|im_end|>\n",
    "assistant assistant assistant the quick brown fox jumps over the lazy dog",
    "Speech synthesis turns text into audio; streamvox streams it while it is generated.",
    "Numbers like 2026 and 42 are split into digits. Don't, we'll, it's, I'm, you're.",
    "camelCase words, HTTPServer and getHTTPResponse code test streamVox",
    "camelCase camelCase camelCase camelCase camelCase streamVox streamVox",  # merges across the case change
    "你好，世界。今天天气很好。我们一起说话。",
    "The talker predicts one frame at a time, then the code predictor fills the rest.",
] * 8
# (content, special): ids follow the byte-level vocabulary in this order, like Qwen's.
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<think>", False), ("</think>", False),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
]
BPE_VOCAB = 360  # byte alphabet (256) + merges
TOKENIZER_TEXTS = [
    "Hello world, this is a test.",
    "camelCase HTTPServer getHTTPResponse",
    "你好，世界。Numbers 2026!",
    "  spaces\tand\nnew lines  ",
    "<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>assistant\n",
    "unseen wörds ñ émoji 🙂",
    "paths a/b/c\nand URLs http://x.y/z?q=1",
    "getHTTPResponse XMLHttpRequest iPhone McDonald's",
]
# Tokenizer-only directories with a base vocabulary above 100 000 ids (padded with
# unreachable entries): transformers 4.57.3 swaps the split regex under
# fix_mistral_regex=True unless config.json says it was written by <= 4.57.2.
LARGE_VOCAB = 100_100
LARGE_TOKENIZERS = {"tok_large": "4.57.3", "tok_large_old": "4.57.1"}


def write_text_tokenizer(directory: Path) -> dict[str, int]:
    """vocab.json + merges.txt + tokenizer_config.json the way Qwen2 tokenizers ship them."""
    from tokenizers import (
        Regex,
        Tokenizer,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    corpus = [c.replace("<|im_start|>", "").replace("<|im_end|>", "") for c in CORPUS]
    tok.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(directory))  # vocab.json, merges.txt
    n = tok.get_vocab_size()
    ids = {content: n + i for i, (content, _) in enumerate(ADDED_TOKENS)}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[content]): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": special}
            for content, special in ADDED_TOKENS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>",
                                      "<tts_text_eod>", "<tts_text_bos_single>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return ids


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class TalkerFixture:
    name: str
    talker_hidden: int
    predictor_hidden: int
    num_code_groups: int
    codebook_size: int
    text_hidden: int
    layers: int
    max_new_tokens: int  # written to generation_config.json (the official default path reads it)
    eos_gain: float  # scales the codec head's EOS row: how soon greedy decoding stops
    seed: int


CONFIGS = [
    # Projection between talker (48) and predictor (32); G = 8.
    TalkerFixture("cv_proj", talker_hidden=48, predictor_hidden=32, num_code_groups=8, codebook_size=64,
                  text_hidden=40, layers=2, max_new_tokens=28, eos_gain=1.6, seed=23),
    # Identity projection (32 = 32); G = 4; a different text width.
    TalkerFixture("cv_ident", talker_hidden=32, predictor_hidden=32, num_code_groups=4, codebook_size=64,
                  text_hidden=24, layers=2, max_new_tokens=24, eos_gain=1.4, seed=22),
]

PROMPTS = ["Hello world, this is a test.", "Streaming speech, 2026 camelCase!"]
# (case name, prompt index, speaker, language, non_streaming_mode, max_new_tokens or None)
CASES = [
    ("p0_vivian_en", 0, "Vivian", "English", True, None),
    ("p0_ryan_en", 0, "Ryan", "English", True, None),
    ("p1_vivian_en", 1, "Vivian", "English", True, None),
    ("p1_ryan_en", 1, "Ryan", "English", True, None),
    ("p0_vivian_auto", 0, "Vivian", "Auto", True, None),
    ("p1_dylan_auto", 1, "Dylan", "Auto", True, None),  # dialect speaker: dialect language id
    ("p1_dylan_chinese", 1, "Dylan", "Chinese", True, None),
    ("p0_dylan_en", 0, "Dylan", "English", True, None),  # dialect speaker, English: plain English id
    ("p1_ryan_en_stream", 1, "Ryan", "English", False, None),  # streaming-text prompt mode
    ("p0_vivian_auto_stream", 0, "Vivian", "Auto", False, None),
    ("p0_ryan_en_max5", 0, "Ryan", "English", True, 5),  # max_new_tokens = 5 -> at most 4 frames
    ("p0_vivian_en_instruct", 0, "Vivian", "English", True, None),  # + INSTRUCT (text-only positions first)
]
INSTRUCT = {"p0_vivian_en_instruct": "Speak slowly and warmly."}


def talker_config(fc: TalkerFixture, text_ids: dict[str, int]) -> dict:
    cb = fc.codebook_size
    special = cb  # special ids sit above the codebook, like 2048.. in the releases
    return dict(
        code_predictor_config=dict(
            vocab_size=cb, hidden_size=fc.predictor_hidden, intermediate_size=2 * fc.predictor_hidden,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=fc.predictor_hidden // 4,
            rms_norm_eps=1e-6, rope_theta=1_000_000, max_position_embeddings=64, num_code_groups=fc.num_code_groups,
        ),
        # The official generate() suppresses [V - 1024, V) except EOS, so V = codebook + 1024 as released.
        vocab_size=cb + 1024, hidden_size=fc.talker_hidden, intermediate_size=2 * fc.talker_hidden,
        num_hidden_layers=fc.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_theta=1_000_000, rms_norm_eps=1e-6, max_position_embeddings=512,
        rope_scaling={"mrope_section": [2, 3, 3], "interleaved": True, "rope_type": "default"},
        num_code_groups=fc.num_code_groups, text_hidden_size=fc.text_hidden,
        text_vocab_size=max(text_ids.values()) + 7,
        codec_pad_id=special + 100, codec_bos_id=special + 101, codec_eos_token_id=special + 102,
        codec_think_id=special + 106, codec_nothink_id=special + 107,
        codec_think_bos_id=special + 108, codec_think_eos_id=special + 109,
        codec_language_id={"chinese": special + 50, "english": special + 51, "german": special + 52,
                           "beijing_dialect": special + 60, "sichuan_dialect": special + 61},
        spk_id={"vivian": special + 200, "ryan": special + 201, "dylan": special + 202, "eric": special + 203},
        spk_is_dialect={"vivian": False, "ryan": False, "dylan": "beijing_dialect", "eric": "sichuan_dialect"},
    )


def model_config(fc: TalkerFixture, text_ids: dict[str, int]):
    return official.Qwen3TTSConfig(
        talker_config=talker_config(fc, text_ids),
        speaker_encoder_config=dict(mel_dim=128, enc_dim=fc.talker_hidden, enc_channels=[32, 32, 32, 32, 96],
                                    enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
                                    enc_attention_channels=16, enc_res2net_scale=4, enc_se_channels=16),
        tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="tiny", tts_model_type="custom_voice",
        im_start_token_id=text_ids["<|im_start|>"], im_end_token_id=text_ids["<|im_end|>"],
        tts_pad_token_id=text_ids["<tts_pad>"], tts_bos_token_id=text_ids["<tts_text_bos>"],
        tts_eos_token_id=text_ids["<tts_text_eod>"],
    )


def generation_config(fc: TalkerFixture) -> dict:
    return {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
            "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0, "subtalker_temperature": 0.9,
            "max_new_tokens": fc.max_new_tokens}


def decoder_fixture(fc: TalkerFixture) -> FixtureConfig:
    """The speech-tokenizer config of make_fixtures.py at this codebook size / G."""
    return FixtureConfig(fc.name, talker_hidden=fc.talker_hidden, predictor_hidden=fc.predictor_hidden,
                         num_code_groups=fc.num_code_groups, codebook_size=fc.codebook_size,
                         sliding_window=8, decode_frames=12)


# --------------------------------------------------------------------------- build


def build_and_save(fc: TalkerFixture, directory: Path) -> None:
    text_ids = write_text_tokenizer(directory)
    g = torch.Generator().manual_seed(5000 + fc.seed)
    model = official.Qwen3TTSForConditionalGeneration(model_config(fc, text_ids)).eval()
    randomize_(model.talker, g)  # every talker parameter, code predictor included
    with torch.no_grad():
        eos = model.config.talker_config.codec_eos_token_id
        model.talker.codec_head.weight[eos] *= fc.eos_gain
    tokenizer = official.Qwen3TTSTokenizerV2Model(tokenizer_config(decoder_fixture(fc))).eval()
    randomize_(tokenizer.decoder, g)
    calibrate_output_scale_(tokenizer.decoder, decoder_fixture(fc), g)

    model.save_pretrained(directory, safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())
    config["speaker_encoder_config"].pop("model_type", None)  # see make_fixtures.save_checkpoint
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (directory / "generation_config.json").write_text(json.dumps(generation_config(fc), indent=2))
    st_dir = directory / "speech_tokenizer"
    tokenizer.save_pretrained(st_dir, safe_serialization=True)
    (st_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))


class StepRecorder:
    """Captures the talker's prefill inputs and the raw codec-head logits of every step,
    and the code predictor's per-step logits (for the near-tie check)."""

    def __init__(self, talker):
        self.prefill: torch.Tensor | None = None
        self.talker_logits: list[torch.Tensor] = []
        self.predictor_logits: list[torch.Tensor] = []
        self.handles = [
            talker.register_forward_hook(self._talker, with_kwargs=True),
            talker.code_predictor.register_forward_hook(self._predictor, with_kwargs=True),
        ]

    def _talker(self, module, args, kwargs, out):
        embeds = kwargs.get("inputs_embeds")
        if embeds is not None and embeds.shape[1] > 1:
            self.prefill = embeds[0].detach().clone()
        self.talker_logits.append(out.logits[0, -1].detach().clone())

    def _predictor(self, module, args, kwargs, out):
        self.predictor_logits.append(out.logits[0, -1].detach().clone())

    def close(self):
        for h in self.handles:
            h.remove()


def processed_margin(logits: torch.Tensor, codes0: list[int], cfg, penalty: float) -> float:
    """Smallest top-2 gap of the talker's greedy choices after the official processors."""
    v = logits.shape[-1]
    eos = cfg.codec_eos_token_id
    allowed = torch.zeros(v, dtype=torch.bool)
    allowed[: max(0, v - 1024)] = True
    allowed[eos] = True
    margin = float("inf")
    for step, row in enumerate(logits):
        x = row.clone().double()
        seen = sorted(set(codes0[:step]))
        if seen:
            s = x[seen]
            x[seen] = torch.where(s < 0, s * penalty, s / penalty)
        x[~allowed] = float("-inf")
        if step < 2:
            x[eos] = float("-inf")
        top2 = x.topk(2).values
        margin = min(margin, (top2[0] - top2[1]).item())
    return margin


def run_case(tts: Qwen3TTSModel, case, refs: dict, fc: TalkerFixture) -> dict:
    name, prompt, speaker, language, non_streaming, max_new = case
    rec = StepRecorder(tts.model.talker)
    captured = []
    original_generate = tts.model.generate

    def generate_and_keep(*args, **kwargs):  # instrumentation only: keep what generate() returned
        result = original_generate(*args, **kwargs)
        captured.append(result)
        return result

    tts.model.generate = generate_and_keep
    kwargs = {} if max_new is None else {"max_new_tokens": max_new}
    try:
        wavs, sr = tts.generate_custom_voice(PROMPTS[prompt], speaker=speaker, language=language,
                                             instruct=INSTRUCT.get(name), non_streaming_mode=non_streaming,
                                             do_sample=False,
                                             subtalker_dosample=False, **kwargs)
    finally:
        rec.close()
        del tts.model.generate
    assert sr == 24000, sr
    cfg = tts.model.config.talker_config
    g = cfg.num_code_groups
    codes = captured[0][0][0].detach().clone().long()  # talker_codes_list[0]: [T, G]
    frames = codes.shape[0]
    wav = torch.from_numpy(wavs[0]).float()
    assert wav.shape[0] == frames * 1920, (wav.shape, frames)

    logits = torch.stack(rec.talker_logits)  # [steps, V] raw codec-head logits, one per talker forward
    pred = torch.stack(rec.predictor_logits) if rec.predictor_logits else torch.zeros(0, 1)
    assert pred.shape[0] == frames * (g - 1), (pred.shape, frames)
    # Cross-check the recording: the processed argmax of every step's logits is code 0 of the
    # next frame (or EOS), and the predictor's argmaxes are codes 1..G-1.
    penalty = tts.generate_defaults.get("repetition_penalty", 1.05)
    replay: list[int] = []
    for step, row in enumerate(logits):
        x = row.clone()
        seen = sorted(set(replay))
        if seen:
            s = x[seen]
            x[seen] = torch.where(s < 0, s * penalty, s / penalty)
        allowed = torch.zeros_like(x, dtype=torch.bool)
        allowed[: max(0, x.shape[0] - 1024)] = True
        allowed[cfg.codec_eos_token_id] = True
        x[~allowed] = float("-inf")
        if step < 2:
            x[cfg.codec_eos_token_id] = float("-inf")
        replay.append(int(x.argmax()))
    assert replay[:frames] == codes[:, 0].tolist(), f"{fc.name}/{name}: replayed code 0 differs"
    if frames:
        assert torch.equal(pred.argmax(-1).view(frames, g - 1), codes[:, 1:]), f"{fc.name}/{name}: predictor"
    ended_by_eos = len(replay) > frames and replay[frames] == cfg.codec_eos_token_id
    margin = processed_margin(logits, replay, cfg, penalty)
    top2 = pred.topk(2, dim=-1).values if frames else None
    pmargin = (top2[:, 0] - top2[:, 1]).min().item() if frames else 1.0
    if min(margin, pmargin) < MIN_MARGIN:
        raise AssertionError(f"{fc.name}/{name}: near-tie in greedy decoding (talker {margin:.2e}, "
                             f"predictor {pmargin:.2e}); change the config seed")
    refs[f"case/{name}/codes"] = codes
    refs[f"case/{name}/wav"] = wav
    refs[f"case/{name}/prefill"] = rec.prefill
    refs[f"case/{name}/logits"] = logits
    return {"prompt": PROMPTS[prompt], "speaker": speaker, "language": language,
            "non_streaming_mode": non_streaming, "max_new_tokens": max_new, "instruct": INSTRUCT.get(name),
            "frames": frames,
            "ended_by_eos": ended_by_eos, "talker_margin": margin, "predictor_margin": pmargin}


def write_large_tokenizer(source: Path, directory: Path, transformers_version: str) -> dict[str, torch.Tensor]:
    """A copy of ``source``'s tokenizer with the base vocabulary padded past 100 000 ids;
    returns the official processor's ids for TOKENIZER_TEXTS."""
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSProcessor
    from transformers import AutoConfig, AutoProcessor

    directory.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((source / "vocab.json").read_text(encoding="utf-8"))
    n = len(vocab)
    vocab.update({f"<|unused_{i}|>": i for i in range(n, LARGE_VOCAB)})
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text((source / "merges.txt").read_text(encoding="utf-8"), encoding="utf-8")
    tok_config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_config["added_tokens_decoder"] = {str(int(k) - n + LARGE_VOCAB): v
                                          for k, v in tok_config["added_tokens_decoder"].items()}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    config = json.loads((source / "config.json").read_text())
    config["transformers_version"] = transformers_version
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    AutoConfig.register("qwen3_tts", Qwen3TTSConfig, exist_ok=True)
    AutoProcessor.register(Qwen3TTSConfig, Qwen3TTSProcessor, exist_ok=True)
    processor = AutoProcessor.from_pretrained(str(directory), fix_mistral_regex=True)  # as Qwen3TTSModel does
    assert processor.tokenizer.vocab_size == LARGE_VOCAB, processor.tokenizer.vocab_size
    split = json.loads(processor.tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]["pretokenizers"][0]
    (directory / "official_split_regex.txt").write_text(split["pattern"]["Regex"], encoding="utf-8")
    return {f"tok/{i}": torch.tensor(processor(text=text)["input_ids"][0], dtype=torch.long)
            for i, text in enumerate(TOKENIZER_TEXTS)}


def main(out: Path) -> None:
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"qwen_tts": "0.1.1", "transformers": official.transformers.__version__,
                "torch": torch.__version__, "prompts": PROMPTS, "tokenizer_texts": TOKENIZER_TEXTS,
                "checkpoints": {}}
    for fc in CONFIGS:
        t0 = time.time()
        directory = out / fc.name
        build_and_save(fc, directory)
        tts = Qwen3TTSModel.from_pretrained(str(directory), dtype=torch.float32, local_files_only=True,
                                            attn_implementation="sdpa")
        tts.model.eval()
        refs: dict[str, torch.Tensor] = {}
        for i, text in enumerate(TOKENIZER_TEXTS):
            refs[f"tok/{i}"] = torch.tensor(tts.processor(text=text)["input_ids"][0], dtype=torch.long)
        cases = {case[0]: run_case(tts, case, refs, fc) for case in CASES}
        save_file({k: v.contiguous() for k, v in refs.items()}, str(out / f"{fc.name}.reference.safetensors"))
        manifest["checkpoints"][fc.name] = {
            "talker_hidden": fc.talker_hidden, "predictor_hidden": fc.predictor_hidden,
            "num_code_groups": fc.num_code_groups, "codebook_size": fc.codebook_size,
            "max_new_tokens": fc.max_new_tokens, "cases": cases,
        }
        lengths = {k: (v["frames"], "eos" if v["ended_by_eos"] else "max") for k, v in cases.items()}
        print(f"make_talker_fixtures: {fc.name} in {time.time() - t0:.1f}s: {lengths}", flush=True)
    manifest["large_tokenizers"] = {}
    for name, version in LARGE_TOKENIZERS.items():
        refs = write_large_tokenizer(out / CONFIGS[0].name, out / name, version)
        save_file(refs, str(out / f"{name}.reference.safetensors"))
        manifest["large_tokenizers"][name] = {"transformers_version": version}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: make_talker_fixtures.py OUT_DIR")
    main(Path(sys.argv[1]))
