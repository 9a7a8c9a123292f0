"""Every pipeline the engine can run, by name (``EngineConfig.model.pipeline``, ``--source``): one
line each, the folder's ``load`` and ``build`` and what it declares before it is built
(engines/pipelines/profile.py ``Registration``). A new pipeline is a new folder and a line here;
nothing else names one."""

from __future__ import annotations

from engines.checkpoints.qwen3_tts import has_talker_weights
from engines.pipelines.dit import adapter as dit
from engines.pipelines.profile import Registration
from engines.pipelines.talker import adapter as talker

PIPELINES: dict[str, Registration] = {
    "dit": Registration(dit.build, dit.load),
    "talker": Registration(talker.build, talker.load, default_slots=8),
}


def registered(name: str) -> Registration:
    """The pipeline registered as ``name``; ValueError naming every registered pipeline when none is
    (``--source``'s error)."""
    if name not in PIPELINES:
        raise ValueError(f"unknown source {name!r}; choose one of {', '.join(PIPELINES)}")
    return PIPELINES[name]


def pipeline_for(checkpoint: str | None) -> str:
    """The pipeline a checkpoint is served by when none is named: the talker where it has trained
    talker weights, else the DiT."""
    return "talker" if has_talker_weights(checkpoint) else "dit"
