#!/usr/bin/env bash
# Install everything the test suite needs, from this repository's own files.
#   .venv         the project (CPU torch 2.13.0 first, so nothing pulls a CUDA build)
#   .venv-oracle  the official qwen-tts code, kept apart (see scripts/oracle-env.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch; a bare `torch` requirement could pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==${STREAMVOX_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e '.[test,onnx]'

if [ -f scripts/oracle-env.sh ] && [ "${STREAMVOX_SKIP_ORACLE:-0}" != "1" ]; then
  bash scripts/oracle-env.sh
fi
echo "dev-setup: done"
