"""Other TTS services' stock voice names as aliases of the loaded model's voices, so a voice
agent switched over to streamvox keeps its settings (docs/API.md, "Voice aliases").

Each vendor name maps to an OpenAI voice name, which the pipeline's profile has already mapped
onto one of its own voices (the DiT's voice table, a CustomVoice checkpoint's speakers): the alias
lands wherever that OpenAI name does. A ``--voice-aliases`` file adds names or re-points
them (its targets: any voice or alias of the model); a ``null`` target drops one.
"""

from __future__ import annotations

from typing import Mapping

# OpenAI's voice names, onto the DiT's voice table (a CustomVoice talker maps them, sorted, onto
# its speakers in turn: engines/pipelines/talker/adapter.py).
OPENAI_VOICE_ALIASES: dict[str, str] = {
    "alloy": "aria", "echo": "blaze", "fable": "cedar", "onyx": "dune", "nova": "ember",
    "shimmer": "fjord", "ash": "gale", "ballad": "cedar", "coral": "aria", "sage": "dune",
    "verse": "blaze", "marin": "ember", "cedar": "cedar",
}

# The defaults the SDKs and agent frameworks send when a user names no voice, and the names
# their documentation and examples use (read from the installed packages' sources).
VENDOR_VOICE_ALIASES: dict[str, str] = {
    # Deepgram Aura models (the `model` of /v1/speak)
    "aura-2-thalia-en": "nova",  # Deepgram's documentation and SDK examples
    "aura-2-helena-en": "shimmer",  # Pipecat's DeepgramTTSService / DeepgramHttpTTSService default
    "aura-2-andromeda-en": "coral",  # LiveKit's Deepgram plugin default
    "aura-asteria-en": "alloy",  # Deepgram's first Aura default
    # Cartesia voice ids (`voice.id`)
    "f786b574-daa5-4673-aa0c-cbe3e8534c02": "nova",  # LiveKit's Cartesia plugin default (TTSDefaultVoiceId)
    "86e30c1d-714b-4074-a1f2-1cb6b552fb49": "shimmer",  # Pipecat's project scaffolding default
    "71a7ad14-091c-4e8e-a314-022ece01c121": "fable",  # Pipecat's examples
    "6ccbfb76-1fc6-48f7-b71d-91ac6298247b": "alloy",  # the cartesia SDK's placeholder when a context ends
    # ElevenLabs premade voice ids (`voice_id`)
    "hpp4J3VqNfWAUOO0d1Us": "shimmer",  # LiveKit's ElevenLabs plugin default (DEFAULT_VOICE_ID)
    "21m00Tcm4TlvDq8ikWAM": "nova",  # "Rachel", the elevenlabs SDK's examples
    "JBFqnCBsd6RMkjVDRZzb": "onyx",  # "George", the elevenlabs SDK's examples
}


def voice_key(name: str) -> str:
    """How a voice name is matched: any case, surrounding spaces dropped (the one normalisation of
    requests, :meth:`engines.pipelines.profile.Profile.resolve_voice`, and of alias tables)."""
    return name.strip().lower()


def extend_aliases(aliases: Mapping[str, str], voices: tuple[str, ...],
                   extra: Mapping[str, str | None]) -> dict[str, str]:
    """``aliases`` plus ``extra`` (name -> a voice or alias of the model; None drops the name),
    each target resolved to one of ``voices``. Names match in any case, as requests name voices
    (:meth:`engines.pipelines.profile.Profile.resolve_voice`), so an ``extra`` name replaces the
    alias it matches whatever its case ("Nova" re-points "nova"; of two that differ only in case
    the later wins). ValueError naming an alias whose target is neither a voice nor an alias, or
    one that is a voice's own name (the voice would always win)."""
    canonical = {voice_key(v): v for v in voices}
    resolved = {voice_key(name): (name, voice) for name, voice in aliases.items()}  # keyed as requests match
    lookup = {voice_key(k): v for k, v in aliases.items()}
    for name, target in extra.items():
        key, name = voice_key(name), name.strip()
        if key in canonical:
            raise ValueError(f"voice alias {name!r} is the name of the voice {canonical[key]!r}; the voice would "
                             "always win")
        if target is None:
            resolved.pop(key, None)
            continue
        voice = canonical.get(voice_key(target)) or lookup.get(voice_key(target))
        if voice is None:
            raise ValueError(f"voice alias {name!r}: {target!r} is not a voice of this model "
                             f"(voices: {', '.join(voices)}; aliases: {', '.join(sorted(aliases))})")
        resolved[key] = (name, voice)
    return dict(resolved.values())
