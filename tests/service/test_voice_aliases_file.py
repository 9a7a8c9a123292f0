"""``--voice-aliases FILE``: names added to the built-in vendor aliases (or re-pointed, or dropped
with null), resolved against the loaded model when the engine is built; a bad file or a target
that is no voice of the model is one line at start."""

from __future__ import annotations

import json
import types

import pytest

from service.server import build_engine_for
from service.settings import from_args


def settings_with(path, **extra):
    return from_args(types.SimpleNamespace(voice_aliases=str(path), preset="tiny", device="cpu", **extra), env={})


def test_the_file_adds_repoints_and_drops_aliases(tmp_path):
    table = tmp_path / "aliases.json"
    table.write_text(json.dumps({"my-agent-voice": "nova", "aura-2-helena-en": "onyx", "aura-2-thalia-en": None}))
    engine = build_engine_for(settings_with(table))
    aliases = engine.info.voice_aliases
    assert aliases["my-agent-voice"] == aliases["nova"] and aliases["aura-2-helena-en"] == aliases["onyx"]
    assert "aura-2-thalia-en" not in aliases and aliases["aura-2-andromeda-en"] in engine.info.voices
    assert engine.resolve_voice("MY-AGENT-VOICE") == aliases["nova"]
    table.write_text(json.dumps({"x": "nobody"}))
    with pytest.raises(ValueError, match="voice alias 'x': 'nobody' is not a voice of this model"):
        build_engine_for(settings_with(table))


def test_names_in_the_file_match_in_any_case_as_requests_do(tmp_path):
    """Requests name voices in any case, so the file's names are matched the same way: "Nova"
    re-points the built-in "nova" (it never won before), " AURA-2-HELENA-EN " re-points Pipecat's
    default and a null in any case drops an alias; a name that is a voice's own is refused."""
    table = tmp_path / "aliases.json"
    table.write_text(json.dumps({"Nova": "onyx", " AURA-2-HELENA-EN ": "fable", "Aura-2-Thalia-EN": None}))
    engine = build_engine_for(settings_with(table))
    stock = build_engine_for(from_args(types.SimpleNamespace(preset="tiny", device="cpu"), env={}))
    assert stock.resolve_voice("nova") != stock.resolve_voice("onyx")  # (so the test can fail)
    for name in ("nova", "Nova", "NOVA"):
        assert engine.resolve_voice(name) == engine.resolve_voice("onyx"), name
    assert engine.resolve_voice("aura-2-helena-en") == engine.resolve_voice("fable")
    assert not {"aura-2-thalia-en", "Aura-2-Thalia-EN"} & set(engine.info.voice_aliases)
    assert sum(name.lower() == "nova" for name in engine.info.voice_aliases) == 1  # one alias, the file's
    voice = engine.info.voices[0]
    table.write_text(json.dumps({voice.upper(): "onyx"}))
    with pytest.raises(ValueError, match=f"is the name of the voice '{voice}'"):
        build_engine_for(settings_with(table))


def test_two_names_that_differ_only_in_case_are_one_line_at_start(tmp_path):
    table = tmp_path / "aliases.json"
    table.write_text(json.dumps({"Nova": "onyx", "nova": "alloy"}))
    with pytest.raises(ValueError, match="^--voice-aliases: .*'Nova' and 'nova' differ only in case"):
        settings_with(table)


@pytest.mark.parametrize("content, says", [(None, "cannot read"), ("{", "not JSON"), ("[1]", "expected one JSON object"),
                                           ('{"a": 3}', "expected one JSON object")])
def test_a_bad_file_is_one_line_naming_the_flag(tmp_path, content, says):
    path = tmp_path / "aliases.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"^--voice-aliases: .*{says}"):
        settings_with(path)
