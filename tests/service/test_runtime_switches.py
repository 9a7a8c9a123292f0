"""The engine's device switches come from the environment through the service's settings (the
only place that reads it), with the meanings they had when the engine read them itself."""

from __future__ import annotations

import pytest

from engines.config import RuntimeSwitches
from service.settings import from_args, runtime_switches


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
