#!/usr/bin/env bash
# Install everything the test suite needs, from this repository's own files.
#   .venv         the project (CPU torch 2.13.0 first, so nothing pulls a CUDA build)
#   .venv-oracle  the official qwen-tts code, kept apart (see scripts/oracle-env.sh)
#   .venv-aligner the official qwen-asr forced aligner, kept apart (see scripts/aligner-oracle-env.sh)
#   .venv-agents  the voice-agent SDKs the dialect tests run as clients (see scripts/agents-env.sh)
#   chromium      Debian's browser for the playground test (tests/service/http/test_playground.py), via apt as root
#   postgresql    server binaries for the shared job store's tests, via apt as root when missing
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_TAG=dev-setup
source scripts/lib/venv.sh

venv_create .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch first (scripts/lib/venv.sh says why); the oracle venvs below use the same index.
export STREAMVOX_TORCH_INDEX=${STREAMVOX_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
echo "dev-setup: torch $TORCH_VERSION (CPU build) from $STREAMVOX_TORCH_INDEX"
venv_install_cpu_torch .venv
echo "dev-setup: streamvox with the test and onnx extras"
.venv/bin/python -m pip install -q -e '.[test,onnx]'

# Chromium drives the playground test (Playwright uses it; never `playwright install`).
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "dev-setup: installing chromium (apt)"
    apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "dev-setup: chromium is missing: sudo apt-get install -y chromium chromium-driver (tests/service/http/test_playground.py needs it)"
  fi
fi

# PostgreSQL server binaries: the shared job store's tests start a real server from them
# (testsupport/postgres.py: initdb in a temp dir, loopback port). Debian's package is enough.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "dev-setup: installing postgresql (apt)"
    apt-get update -qq && apt-get install -y -qq postgresql >/dev/null
  else
    echo "dev-setup: PostgreSQL is missing: sudo apt-get install -y postgresql (the job store tests, tests/service/jobs/, start a server with initdb: testsupport/postgres.py)"
  fi
fi

# The ElevenLabs / LiveKit / Pipecat SDKs, kept apart from the project (tests/service/ws/dialects/test_dialects_sdks.py).
bash scripts/agents-env.sh

if [ -f scripts/oracle-env.sh ] && [ "${STREAMVOX_SKIP_ORACLE:-0}" != "1" ]; then
  bash scripts/oracle-env.sh
fi
# The forced aligner's oracle (official qwen-asr, its own venv): tests/engines/pipelines/aligner/test_aligner_parity.py.
if [ -f scripts/aligner-oracle-env.sh ] && [ "${STREAMVOX_SKIP_ORACLE:-0}" != "1" ]; then
  bash scripts/aligner-oracle-env.sh
fi
echo "dev-setup: done"
