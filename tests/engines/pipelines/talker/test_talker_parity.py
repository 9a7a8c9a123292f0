"""Talker parity against the official qwen-tts ``generate_custom_voice`` (oracle fixtures).

Fixtures: ``bash scripts/oracle-talker-fixtures.sh``. fp32 on both sides; greedy codes must
be identical, continuous values within 1e-5 relative to the reference's largest magnitude
(measured: ~1e-7 for the prompt and logits; the tolerance catches any wrong eps, RoPE
section, scale or tensor, which move values by 1e-3 or more).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from engines.checkpoints.qwen3_text import QwenTextTokenizer
from engines.checkpoints.qwen3_tts import load_checkpoint
from engines.pipelines.talker.reference import (
    TalkerBundle,
    frame_embedding,
    prompt_tensors,
)
from tests.oracle import talker_fixtures as fx

pytestmark = pytest.mark.parity
REL_TOL = 1e-5
WAV_TOL = 1e-5



@pytest.fixture(scope="module", params=fx.CHECKPOINTS)
def ckpt(request):
    name = request.param
    return name, TalkerBundle.from_checkpoint(fx.checkpoint_dir(name)), fx.references(name), fx.cases(name)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def test_tokenizer_ids_equal_official_processor(ckpt):
    name, _, refs, _ = ckpt
    tok = QwenTextTokenizer.from_dir(fx.checkpoint_dir(name))
    texts = fx.manifest()["tokenizer_texts"]
    for i, text in enumerate(texts):
        assert tok.encode(text) == refs[f"tok/{i}"].tolist(), text
    # The role and the suffix are single tokens, so ids[3:-5] is exactly the text.
    ids = tok.encode("<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>assistant\n")
    assert ids[:3] == ids[-3:] and tok.decode(ids[3:-5]) == "Hi there."


def test_prefill_embeddings_match(ckpt):
    _, bundle, refs, cases = ckpt
    for case, c in cases.items():
        prompt = bundle.prompt.build(c["prompt"], c["speaker"], c["language"], c["non_streaming_mode"],
                                     instruct=c["instruct"])
        x, _, _ = prompt_tensors(bundle.talker, prompt, "cpu")
        assert rel_err(x, refs[f"case/{case}/prefill"]) < REL_TOL, case


@torch.no_grad()
def test_teacher_forced_logits_match(ckpt):
    """Our talker fed the official codes: every step's raw codec logits within 1e-5."""
    _, bundle, refs, cases = ckpt
    talker = bundle.talker
    for case, c in cases.items():
        codes = refs[f"case/{case}/codes"]
        expected = refs[f"case/{case}/logits"]  # [steps, V]
        prompt = bundle.prompt.build(c["prompt"], c["speaker"], c["language"], c["non_streaming_mode"],
                                     instruct=c["instruct"])
        x, trailing, pad = prompt_tensors(talker, prompt, "cpu")
        s = x.shape[0]
        cache = talker.new_cache(1, s + expected.shape[0], "cpu", torch.float32)
        h = talker(x[None], torch.arange(s)[None], cache, attend_len=s)
        ours = [talker.logits(h)[0]]
        for step in range(expected.shape[0] - 1):
            text = trailing[step] if step < trailing.shape[0] else pad
            nxt = frame_embedding(talker, bundle.predictor, codes[step:step + 1]) + text
            h = talker(nxt[:, None], torch.tensor([[s + step]]), cache, attend_len=s + step + 1)
            ours.append(talker.logits(h)[0])
        assert rel_err(torch.stack(ours), expected) < REL_TOL, case


def test_greedy_codes_identical_to_official(ckpt):
    name, bundle, refs, cases = ckpt
    for case, c in cases.items():
        codes = bundle.generate_codes(c["prompt"], c["speaker"], c["language"], greedy=True,
                                      max_new_tokens=c["max_new_tokens"], non_streaming_mode=c["non_streaming_mode"],
                                      instruct=c["instruct"])
        expected = refs[f"case/{case}/codes"]
        assert codes.shape == expected.shape and torch.equal(codes, expected), (name, case)


def test_defaults_follow_the_checkpoint(ckpt):
    """None arguments = what generate_custom_voice does: non-streaming text, the file's
    max_new_tokens (N tokens -> at most N-1 frames) and repetition penalty."""
    name, bundle, refs, cases = ckpt
    limit = fx.manifest()["checkpoints"][name]["max_new_tokens"]
    assert bundle.generation.max_new_tokens == limit and bundle.generation.repetition_penalty == 1.05
    hit_limit = [k for k, c in cases.items()
                 if c["max_new_tokens"] is None and not c["ended_by_eos"] and not c["instruct"]]
    assert hit_limit, "fixtures should hold a case that runs to max_new_tokens"
    for case in hit_limit[:2]:
        c = cases[case]
        codes = bundle.generate_codes(c["prompt"], c["speaker"], c["language"], greedy=True)
        assert codes.shape[0] == limit - 1 and torch.equal(codes, refs[f"case/{case}/codes"])
    # The penalty is really in force: without it some case's greedy codes change.
    changed = []
    for case, c in cases.items():
        no_penalty = bundle.generate_codes(c["prompt"], c["speaker"], c["language"], greedy=True,
                                           max_new_tokens=c["max_new_tokens"], instruct=c["instruct"],
                                           non_streaming_mode=c["non_streaming_mode"], repetition_penalty=1.0)
        expected = refs[f"case/{case}/codes"]
        changed.append(no_penalty.shape != expected.shape or not torch.equal(no_penalty, expected))
    assert any(changed)


def test_waveform_with_our_decoder(ckpt):
    name, _, refs, cases = ckpt
    parts = load_checkpoint(fx.checkpoint_dir(name))
    for case in cases:
        codes = refs[f"case/{case}/codes"]
        wav = parts.decode(codes.T[None])[0]
        expected = refs[f"case/{case}/wav"]
        assert wav.shape == expected.shape
        assert (wav - expected).abs().max().item() < WAV_TOL, case
        assert (expected.abs() >= 1.0).float().mean().item() < 0.01  # not hidden behind clipping


def test_oracle_outputs_depend_on_inputs(ckpt):
    """Text, speaker, language and text mode each change the official codes (the
    comparison is not blind); a dialect speaker under Auto and Chinese gets one id."""
    _, bundle, refs, cases = ckpt
    codes = {case: refs[f"case/{case}/codes"] for case in cases}

    def differ(a: str, b: str) -> bool:
        return codes[a].shape != codes[b].shape or not torch.equal(codes[a], codes[b])

    factors = {  # case pairs that differ in one input only
        "speaker": [("p0_vivian_en", "p0_ryan_en"), ("p1_vivian_en", "p1_ryan_en"), ("p0_dylan_en", "p0_vivian_en"),
                    ("p0_dylan_en", "p0_ryan_en")],
        "text": [("p0_vivian_en", "p1_vivian_en"), ("p0_ryan_en", "p1_ryan_en")],
        "language": [("p0_vivian_en", "p0_vivian_auto")],
        "instruct": [("p0_vivian_en", "p0_vivian_en_instruct")],
        "text mode": [("p1_ryan_en", "p1_ryan_en_stream"), ("p0_vivian_auto", "p0_vivian_auto_stream")],
    }
    for factor, pairs in factors.items():
        assert any(differ(a, b) for a, b in pairs), f"{factor} never changes the official greedy codes"
    assert torch.equal(codes["p1_dylan_auto"], codes["p1_dylan_chinese"])
    cfg = bundle.prompt.config
    auto = bundle.prompt.build("x", "Dylan", "Auto")
    assert cfg.language_ids["beijing_dialect"] in auto.codec_ids
    english = bundle.prompt.build("x", "Dylan", "English")
    assert cfg.language_ids["english"] in english.codec_ids and cfg.language_ids["beijing_dialect"] not in english.codec_ids
    # Every pair of distinct (prompt, speaker, language, mode) cases has different first-step
    # logits (greedy codes of short random-weight runs may still coincide).
    distinct = [k for k in cases if k not in ("p1_dylan_chinese", "p0_ryan_en_max5")]
    for a, b in itertools.combinations(distinct, 2):
        la, lb = refs[f"case/{a}/logits"][0], refs[f"case/{b}/logits"][0]
        assert rel_err(la, lb) > 1e-3, (a, b)


@pytest.mark.parametrize("name", ["tok_large", "tok_large_old"])
def test_large_vocabulary_split_regex_as_official(name):
    """Base vocabulary > 100 000: the official processor (fix_mistral_regex=True) swaps the
    split regex when config.json says transformers 4.57.3 wrote it, keeps it for 4.57.1; we
    decide the same way and tokenize identically (camelCase is where the two differ)."""
    info = fx.manifest()["large_tokenizers"]
    if name not in info:
        fx._unavailable(f"lack tokenizer {name!r}")
    directory = fx.FIXTURES / name
    tok = QwenTextTokenizer.from_dir(directory)
    assert tok.split_regex == (directory / "official_split_regex.txt").read_text(encoding="utf-8")
    refs = fx._references(name)
    for i, text in enumerate(fx.manifest()["tokenizer_texts"]):
        assert tok.encode(text) == refs[f"tok/{i}"].tolist(), text
    other = fx._references("tok_large_old" if name == "tok_large" else "tok_large")
    assert any(refs[k].tolist() != other[k].tolist() for k in refs), "the two regexes must differ on some text"
