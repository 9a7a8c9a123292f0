"""The engine's device switches come from the environment through the service's settings (the
only place that reads it), with the meanings they had when the engine read them itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engines.config import RuntimeSwitches
from service.settings import from_args, runtime_switches

ROOT = Path(__file__).resolve().parents[2]


def test_the_environment_reads_as_before():
    default = runtime_switches({})
    assert default == RuntimeSwitches() and default.talker_step_graphs and not default.stage_sync
    assert (default.compile_backend("predictor"), default.compile_backend("dit"), default.compile_backend("talker")) \
        == ("inductor", None, None)
    assert runtime_switches({"STREAMVOX_COMPILE": "0"}).compile_backend("predictor") is None
    assert runtime_switches({"STREAMVOX_COMPILE_TALKER": "1"}).compile_backend("talker") == "inductor"
    assert runtime_switches({"STREAMVOX_COMPILE_DIT": "1"}).compile_backend("dit") == "inductor"
    assert runtime_switches({"STREAMVOX_COMPILE_DIT": "1", "STREAMVOX_COMPILE": "0"}).compile_backend("dit") is None
    assert not runtime_switches({"STREAMVOX_TALKER_STEP_GRAPHS": "0"}).talker_step_graphs
    assert runtime_switches({"STREAMVOX_TALKER_STEP_GRAPHS": "yes"}).talker_step_graphs  # only "0" turns it off
    assert runtime_switches({"STREAMVOX_STAGE_SYNC": "1"}).stage_sync
    assert default.prefill_graphs and not runtime_switches({"STREAMVOX_PREFILL_GRAPHS": "0"}).prefill_graphs
    assert default.batched_admission and not runtime_switches({"STREAMVOX_BATCHED_ADMISSION": "0"}).batched_admission
    assert from_args(None, {"STREAMVOX_STAGE_SYNC": "1"}).runtime == RuntimeSwitches(stage_sync=True)



def test_the_fused_kernels_are_off_unless_switched_on():
    default = runtime_switches({})
    assert default.fused_predictor == "off" and not default.fused_talker
    assert runtime_switches({"STREAMVOX_FUSED_PREDICTOR": "Persistent"}).fused_predictor == "persistent"
    assert runtime_switches({"STREAMVOX_FUSED_PREDICTOR": "phased"}).fused_predictor == "phased"
    assert runtime_switches({"STREAMVOX_FUSED_PREDICTOR": "0"}).fused_predictor == "off"
    assert runtime_switches({"STREAMVOX_FUSED_TALKER": "1"}).fused_talker
    with pytest.raises(ValueError, match="off, phased or persistent"):
        runtime_switches({"STREAMVOX_FUSED_PREDICTOR": "yes"})


def test_the_paged_attention_switch_reads_as_before():
    """STREAMVOX_PAGED_ATTENTION=0 (the engine read it on every decode attention call) now turns the
    switch off through the settings; what the engine does with it: tests/engines/models/test_paged_attention.py."""
    assert RuntimeSwitches().paged_attention and runtime_switches({}).paged_attention
    assert not runtime_switches({"STREAMVOX_PAGED_ATTENTION": "0"}).paged_attention
    assert runtime_switches({"STREAMVOX_PAGED_ATTENTION": "1"}).paged_attention
    assert from_args(None, {"STREAMVOX_PAGED_ATTENTION": "0"}).runtime == RuntimeSwitches(paged_attention=False)


def test_nothing_under_engines_reads_the_environment():
    """The settings are the one reader of the environment; the engine is handed what they read."""
    readers = []
    for path in sorted((ROOT / "engines").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                     and node.attr in ("environ", "environb", "getenv", "getenvb"))
            imported = isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                alias.name in ("environ", "environb", "getenv", "getenvb") for alias in node.names)
            if named or imported:
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not readers, f"read it in service/settings.py (RuntimeSwitches) and hand it down: {readers}"
