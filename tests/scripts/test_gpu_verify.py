"""The prepared GPU measurement (scripts/gpu-verify.sh quick) dry-run on the CPU at tiny sizes:
every step runs (checkpoint, kernel test, cost table, served talker, the peer beside ours, talker
benchmark beside the official code, and the steps named after ``quick``: profile, served DiT,
served variants, prefix cache, the open-loop first-audio benchmark served and on the virtual device) and prints its table, so the script a GPU session runs once cannot rot."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ORACLE = REPO / ".venv-oracle" / "bin" / "python"


# Two files on two lines, as the script's own list is written (a newline once broke the step).
DRY_TESTS = "tests/engines/pipelines/talker/test_talker_paged.py\n  tests/engines/runtime/test_graphed_dit.py"


def test_the_cuda_test_list_names_files_that_exist():
    script = (REPO / "scripts" / "gpu-verify.sh").read_text()
    listed = re.search(r'CUDA_TESTS="([^"]*)"', script).group(1).split()
    assert len(listed) >= 7 and all((REPO / f).is_file() for f in listed), [f for f in listed if not (REPO / f).is_file()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_gpu_run_dry_runs_every_step_on_cpu(tmp_path):
    if not ORACLE.is_file():
        if os.environ.get("CI"):
            pytest.fail("no .venv-oracle (scripts/oracle-env.sh): the dry run needs the official code")
        pytest.skip("no .venv-oracle (scripts/oracle-env.sh)")
    out = tmp_path / "out"
    env = dict(os.environ, GPU_VERIFY_DRY="1", OUT=str(out), QUICK_BUDGET_S="560",
               CKPT_DIR=str(tmp_path / "ckpt"), PYTHON=str(REPO / ".venv" / "bin" / "python"),
               ORACLE_PYTHON=str(ORACLE), TESTS=DRY_TESTS)  # on a CPU: collected, skipped
    named = ["profile_talker", "dit_e2e", "talker_e2e_ctalk", "talker_e2e_eager", "prefix_cache",
             "openloop", "openloop_virtual"]  # not in quick
    proc = subprocess.run(["bash", "scripts/gpu-verify.sh", "quick", *named], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=590)
    log = (out / "gpu-verify.log").read_text()
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in ("env", "ckpt", "kernel", "prefill_graphs", "admission", "costs", "talker_e2e", "peers", "talker_bench", "tests", *named):
        assert f"END {step} ok" in log, f"step {step} did not finish:\n{log[-4000:]}"
    assert "FAILED" not in log and "TIMED OUT" not in log, log[-4000:]
    assert all(f"== {f}" in log for f in DRY_TESTS.split()), log[-4000:]  # every file of a multi-line list ran
    # each step's figures, not only its exit status
    # the talker table: every variant beside the official
    assert "official / ours" in log and all(f"{variant} |" in log for variant in ("ours", "ours+graphs", "ours+ctalk"))
    assert "official baseline failed" not in log and "official baseline skipped" not in log
    assert log.count("largest concurrency with no underrun and no error") == 4  # talker, DiT, compiled, eager
    assert log.count("graph captures after start (each stalls every stream): 0") == 4
    # the cost table the virtual device replays, every section filled
    costs = json.loads((out / "costs-tiny.json").read_text())
    assert costs["schema"] == 1 and all(costs[k]["ms"] and all(v is not None for row in costs[k]["ms"] for v in row)
                                        for k in ("decode_step", "prefill", "codec_decode"))
    # the peer step: ours measured whether or not the peer is installed here
    assert "bench_peers:" in log and re.search(r"\nours +[0-9.]+ +[0-9.]+ +[0-9.]+", log), log[-4000:]
    # the open-loop first-audio table, served and on the virtual device of the table just measured
    assert log.count("p95 first audio crosses 100 ms at") == 2 and "virtual device" in log, log[-4000:]
    assert "top kernels by CPU time" in log  # the profile's summary
    assert (out / "trace_talker.json.gz").is_file()
    # the prefix-cache table, cold beside warm per scenario
    assert "prefix cache TTFA: size=tiny fp32 rounds=1" in log
    scenarios = ("built-in speaker, new text", "saved voice (in-context), same text",
                 "VoiceDesign instructions, new text")
    assert all(f"| {scenario} |" in log for scenario in scenarios), log[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fused_step_dry_runs_on_cpu(tmp_path):
    """``scripts/gpu-verify.sh ckpt fused`` at tiny sizes: the CUDA tests collected (skipped here), the
    bench's table with every variant (the kernels under Triton's interpreter), the fused cost table."""
    if not ORACLE.is_file():
        if os.environ.get("CI"):
            pytest.fail("no .venv-oracle (scripts/oracle-env.sh): the dry run needs the official code")
        pytest.skip("no .venv-oracle (scripts/oracle-env.sh)")
    out = tmp_path / "out"
    env = dict(os.environ, GPU_VERIFY_DRY="1", OUT=str(out), QUICK_BUDGET_S="560", CKPT_DIR=str(tmp_path / "ckpt"),
               PYTHON=str(REPO / ".venv" / "bin" / "python"), ORACLE_PYTHON=str(ORACLE))
    proc = subprocess.run(["bash", "scripts/gpu-verify.sh", "env", "ckpt", "fused"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=590)
    log = (out / "gpu-verify.log").read_text()
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in ("ckpt", "fused_check", "fused_bench", "fused_costs"):
        assert f"END {step} ok" in log, f"step {step} did not finish:\n{log[-4000:]}"
    assert "FAILED" not in log and "TIMED OUT" not in log, log[-4000:]
    assert re.search(r"\d+ skipped", log), "the fused CUDA tests were collected"
    for variant in ("graphed", "fused-persistent", "fused-phased", "fused-all"):
        assert re.search(rf"\n\| {variant} \| 1 \| 1 \| [0-9.]+ \|", log), variant
    assert "graphed / fused at 1 rows x 1 blocks" in log
    from engines.virtual.costs import CostTable

    table = CostTable.load(out / "costs-tiny-fused.json")
    assert "fused kernels" in table.notes and table.decode_step.ms[0][0] > 0
