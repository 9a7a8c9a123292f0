"""Prompt layout, tokenizer regex decision, generation-config defaults, fixture gate (no oracle)."""

from __future__ import annotations

import pytest
import torch

from engines.checkpoints.qwen3_text import _swaps_split_regex
from engines.checkpoints.qwen3_tts import HARD_DEFAULTS, TalkerGenerationConfig
from engines.pipelines.talker.prompt import NO_CODEC
from engines.pipelines.talker.reference import batch_prompt_tensors, prompt_tensors
from testsupport.talker import make_bundle


@pytest.fixture(scope="module")
def bundle():
    return make_bundle(seed=1)


def test_prompt_layout_non_streaming_and_streaming(bundle):
    b = bundle.prompt
    c = b.config
    ids = b.tokenize_assistant("Hello world.")
    body = ids[3:-5]
    assert b.tokenizer.decode(body) == "Hello world." and len(body) >= 2
    p = b.build("Hello world.", "Ryan", "English", non_streaming_mode=True)
    codec_k = [c.codec_think_id, c.codec_think_bos_id, c.language_ids["english"], c.codec_think_eos_id,
               c.speakers["ryan"], c.codec_pad_id, c.codec_bos_id]
    assert list(p.text_ids) == ids[:3] + [c.tts_pad_token_id] * 5 + [c.tts_bos_token_id] + body + [
        c.tts_eos_token_id, c.tts_pad_token_id]
    assert list(p.codec_ids) == [NO_CODEC] * 3 + codec_k[:-1] + [c.codec_pad_id] * (len(body) + 1) + [c.codec_bos_id]
    assert p.trailing_text_ids == () and p.pad_text_id == c.tts_pad_token_id

    s = b.build("Hello world.", "Ryan", "Auto", non_streaming_mode=False)
    codec_auto = [c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id, c.speakers["ryan"], c.codec_pad_id,
                  c.codec_bos_id]
    assert list(s.text_ids) == ids[:3] + [c.tts_pad_token_id] * 4 + [c.tts_bos_token_id] + body[:1]
    assert list(s.codec_ids) == [NO_CODEC] * 3 + codec_auto[:-1] + [c.codec_bos_id]
    assert list(s.trailing_text_ids) == body[1:] + [c.tts_eos_token_id]
    # custom_voice defaults to non-streaming text, like generate_custom_voice.
    assert b.build("Hello world.", "Ryan", "Auto") == b.build("Hello world.", "Ryan", "Auto", True)


def test_dialect_and_case_insensitive_names(bundle):
    b, c = bundle.prompt, bundle.prompt.config
    for lang in ("Auto", "chinese", "CHINESE"):
        assert c.language_ids["beijing_dialect"] in b.build("x", "DYLAN", lang).codec_ids
    assert c.language_ids["beijing_dialect"] not in b.build("x", "Dylan", "English").codec_ids
    with pytest.raises(ValueError, match="language"):
        b.build("x", "Dylan", "beijing_dialect")  # dialects are not user languages (official wrapper)
    assert "beijing_dialect" not in b.languages()


def test_prompt_embeddings_sum_text_and_codec_parts(bundle):
    t = bundle.talker
    p = bundle.prompt.build("Hello", "Vivian", "English")
    x, trailing, pad = prompt_tensors(t, p, "cpu")
    with torch.no_grad():
        i = 3  # first position with a codec part
        want = t.text_part(torch.tensor([p.text_ids[i]])) + t.codec_part(torch.tensor([p.codec_ids[i]]))
        assert torch.allclose(x[i], want[0]) and torch.allclose(x[0], t.text_part(torch.tensor([p.text_ids[0]]))[0])
        assert trailing.shape == (0, t.cfg.hidden_size) and pad.shape == (t.cfg.hidden_size,)


def test_prompts_embedded_together_equal_each_alone(bundle):
    """Admission on a GPU embeds every new prompt in one pass: each prompt's inputs and trailing
    text parts equal its own pass (fp32, within 1e-6: the one GEMM over all prompts may block the
    sums differently from one per prompt; every op is per position)."""
    b, t = bundle.prompt, bundle.talker
    prompts = [b.build("Hello world.", "Ryan", "English", non_streaming_mode=True),
               b.build("the quick brown fox jumps", "Vivian", "Auto", non_streaming_mode=False),
               b.build("a", "Dylan", "Chinese", non_streaming_mode=False)]
    with torch.no_grad():
        xs, trailings, pad = batch_prompt_tensors(t, prompts, "cpu")
        for p, x, trailing in zip(prompts, xs, trailings):
            x1, trailing1, pad1 = prompt_tensors(t, p, "cpu")
            assert x.shape == x1.shape and trailing.shape == trailing1.shape
            assert torch.allclose(x, x1, atol=1e-6, rtol=0) and torch.allclose(trailing, trailing1, atol=1e-6, rtol=0)
            assert torch.equal(pad, pad1)
    assert sum(tr.shape[0] for tr in trailings) > 0, "a streaming prompt has trailing text"


def test_split_regex_decision():
    assert not _swaps_split_regex(5000, {"transformers_version": "4.57.3"})  # small vocabulary
    assert _swaps_split_regex(151_643, {"transformers_version": "4.57.3", "model_type": "qwen3_tts"})
    assert _swaps_split_regex(151_643, {"model_type": "qwen3_tts"})  # no version recorded
    assert not _swaps_split_regex(151_643, {"transformers_version": "4.57.1", "model_type": "qwen3_tts"})
    assert _swaps_split_regex(151_643, {"transformers_version": "4.57.1", "model_type": "mistral"})
    assert not _swaps_split_regex(151_643, {"transformers_version": "5.0.0"})
    assert not _swaps_split_regex(151_643, None)  # no config.json next to the tokenizer


def test_generation_config_merges_like_the_official_wrapper(tmp_path):
    g = TalkerGenerationConfig.from_dict({"max_new_tokens": 77, "repetition_penalty": 1.2})
    assert g.max_new_tokens == 77 and g.repetition_penalty == 1.2 and g.top_k == HARD_DEFAULTS["top_k"]
    assert TalkerGenerationConfig.from_dir(tmp_path).max_new_tokens == 2048  # no file: the package's hard default
    assert g.min_new_tokens == 2


def test_missing_fixtures_fail_under_ci(monkeypatch, tmp_path):
    from tests.oracle import talker_fixtures as fx

    monkeypatch.setattr(fx, "FIXTURES", tmp_path / "nowhere")
    fx._state.cache_clear()
    try:
        monkeypatch.setenv("CI", "true")
        with pytest.raises(pytest.fail.Exception, match="CI=true"):
            fx.manifest()
        monkeypatch.setenv("CI", "false")
        with pytest.raises(pytest.skip.Exception, match="oracle-talker-fixtures.sh"):
            fx.manifest()
    finally:
        fx._state.cache_clear()
