"""Every pipeline the engine can run, by name (``build_engine(source=...)``, ``--source``): one
line each, the folder's ``build`` (engines/pipelines/profile.py says what a builder gets and
returns). A new pipeline is a new folder and a line here."""

from __future__ import annotations

from engines.pipelines.dit import adapter as dit
from engines.pipelines.profile import Builder
from engines.pipelines.talker import adapter as talker

PIPELINES: dict[str, Builder] = {
    "dit": dit.build,
    "talker": talker.build,
}


def pipeline_builder(name: str) -> Builder:
    """The builder registered as ``name``; ValueError naming every registered pipeline when none is
    (``--source``'s error)."""
    if name not in PIPELINES:
        raise ValueError(f"unknown source {name!r}; choose one of {', '.join(PIPELINES)}")
    return PIPELINES[name]
