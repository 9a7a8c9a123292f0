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


@pytest.mark.parametrize("content, says", [(None, "cannot read"), ("{", "not JSON"), ("[1]", "expected one JSON object"),
                                           ('{"a": 3}', "expected one JSON object")])
def test_a_bad_file_is_one_line_naming_the_flag(tmp_path, content, says):
    path = tmp_path / "aliases.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"^--voice-aliases: .*{says}"):
        settings_with(path)
