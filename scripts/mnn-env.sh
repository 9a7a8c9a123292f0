#!/usr/bin/env bash
# Build .venv-mnn: the qwen3-tts-mnn peer (pure-CPU Qwen3-TTS on Alibaba's MNN runtime) that
# benchmarks/bench_talker.py --mnn times beside ours, on a talker exported from our random
# checkpoint by benchmarks/export_mnn.py. A benchmark peer, never a streamvox dependency, so it
# lives in its own venv (numpy + MNN + the peer; no torch). Not used by CI.
#
# Idempotent: the venv is reused when its pins are already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_TAG=mnn-env
source scripts/lib/venv.sh
VENV=.venv-mnn
start=$(date +%s)
PINS=("qwen3-tts-mnn==0.3.1" "MNN==3.6.1")   # MNN: the runtime and converter the peer's 0.3.1 was measured with

venv_create "$VENV"
if ! venv_has_pins "$VENV" "${PINS[@]}"; then
  echo "mnn-env: installing ${PINS[*]} (about a minute)"
  "$VENV/bin/python" -m pip install -q "${PINS[@]}"
fi
echo "mnn-env: venv ready after $(( $(date +%s) - start ))s"
