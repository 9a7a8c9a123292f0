"""The forced aligner against the official qwen-asr code (fixtures: scripts/aligner-oracle-env.sh).

Logits within REL_TOL (fp32, relative to the largest reference magnitude), identical word
lists, input ids and millisecond times per case, every case aligned in ONE batch (so batching
never changes a result), and the timestamp repair equal to the official one on random classes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.pipelines.aligner import Aligner, AlignItem, UnsupportedLanguage
from engines.pipelines.aligner.timestamps import class_times, fix_timestamps
from engines.pipelines.aligner.words import language_support
from tests.oracle import aligner_fixtures as fx
from tests.oracle.fixtures import REL_TOL, rel_err

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def aligner() -> Aligner:
    return Aligner.load(fx.checkpoint_dir())


def _item(name: str, **kw) -> AlignItem:
    case = fx.manifest()["cases"][name]
    return AlignItem(fx.references()[f"{name}.audio"].numpy(), case["text"], case["language"], **kw)


def _needs_nagisa(name: str) -> bool:
    return fx.manifest()["cases"][name]["language"] == "Japanese" and not language_support("japanese").supported


def _official_ms(times_s):
    return [[text, round(s * 1000), round(e * 1000)] for text, s, e in times_s]


@pytest.mark.parametrize("name", fx.CASES)
def test_logits_and_ids_match_the_official_thinker(aligner, name):
    if _needs_nagisa(name):
        with pytest.raises(UnsupportedLanguage):
            aligner.align_batch([_item(name)])
        return
    words, ids, features = aligner._prepare(_item(name))
    refs = fx.references()
    assert words == fx.manifest()["cases"][name]["words"]
    assert ids == refs[f"{name}.input_ids"].tolist()
    # The oracle ran the transformers SDPA path: whole-item audio attention (see AudioEncoder).
    aligner.model.audio_tower.windowed_attention = False
    try:
        logits = aligner.model(torch.tensor([ids]), [features])[0]
    finally:
        aligner.model.audio_tower.windowed_attention = True
    assert rel_err(logits, refs[f"{name}.logits"]) < REL_TOL


def test_batched_times_equal_the_official_solo_times(aligner):
    names = [n for n in fx.CASES if not _needs_nagisa(n) and n != "en_long"]
    got = aligner.align_batch([_item(n) for n in names])
    for name, words in zip(names, got):
        want = _official_ms(fx.manifest()["cases"][name]["times_s"])
        assert [[w.text, w.start_ms, w.end_ms] for w in words] == want, name
    # and a batch of one gives the same
    assert aligner.align_batch([_item(names[0])])[0] == got[0]


def test_official_batch_of_equal_lengths(aligner):
    batch = fx.manifest()["batch"]
    names = [n for n in batch if not _needs_nagisa(n)]
    got = aligner.align_batch([_item(n) for n in names])
    for name, words in zip(names, got):
        assert [[w.text, w.start_ms, w.end_ms] for w in words] == _official_ms(batch[name])


def test_long_item_times_with_whole_item_attention(aligner):
    aligner.model.audio_tower.windowed_attention = False
    try:
        got = aligner.align_batch([_item("en_long")])[0]
    finally:
        aligner.model.audio_tower.windowed_attention = True
    assert [[w.text, w.start_ms, w.end_ms] for w in got] == _official_ms(fx.manifest()["cases"]["en_long"]["times_s"])


def test_timestamp_repair_equals_the_official(aligner):
    for classes, want in fx.manifest()["repairs"]:
        times = fix_timestamps(class_times(torch.tensor(classes), aligner.cfg.timestamp_segment_time))
        assert [[times[2 * k], times[2 * k + 1]] for k in range(len(want))] == want, classes


def test_offsets_spans_and_empty_items(aligner):
    item = _item("de", offset_ms=1234.5)
    words = aligner.align_batch([item])[0]
    plain = aligner.align_batch([_item("de")])[0]
    assert [w.start_ms - 1234.5 for w in words] == [w.start_ms for w in plain]
    text = item.text
    assert [text[w.char_start:w.char_end] for w in words] == ["Grüße", "aus", "München", "schöne", "Straße"]
    # punctuation only, or no audio: no times at all (never invented ones)
    empty = aligner.align_batch([AlignItem(np.zeros(24_000, np.float32), " ,.!? ", "English"),
                                 AlignItem(np.zeros(0, np.float32), "hello", "English")])
    assert empty == [[], []]
    with pytest.raises(UnsupportedLanguage):
        aligner.align_batch([AlignItem(np.zeros(2400, np.float32), "hola", "Klingon")])


def test_capabilities_name_the_tokenizers(aligner):
    caps = aligner.capabilities()
    assert "english" in caps.languages and "korean" in caps.languages
    if language_support("japanese").supported:
        assert "japanese" in caps.languages
    else:
        assert caps.needs_extra["japanese"].startswith("nagisa")
