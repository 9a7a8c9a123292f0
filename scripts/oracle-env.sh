#!/usr/bin/env bash
# Build the Qwen3-TTS *oracle*: a second virtualenv (.venv-oracle) holding the official
# qwen-tts model code, then write the parity fixtures with it (tests/fixtures/oracle/).
#
# Why a separate venv: qwen-tts pins transformers==4.57.3 and declares torchaudio,
# gradio, librosa... as dependencies (torchaudio alone can drag in a multi-GB CUDA
# torch). It is a test oracle, never a runtime dependency of streamvox, so it lives
# apart and is installed with --no-deps next to exactly what its model files import.
#
# Idempotent: the venv is reused when its packages are already right, and the
# fixtures are rebuilt only when the fixture scripts changed (stamp = their sha256).
# Env: ORACLE_FORCE=1 rebuilds the fixtures; PYTHON picks the base interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_TAG=oracle-env
source scripts/lib/venv.sh
VENV=.venv-oracle
OUT=tests/fixtures/oracle
start=$(date +%s)

# What the two model files (and the package modules they pull in) really need.
# sox / onnxruntime / torchaudio / einops are only used by the 25 Hz tokenizer and the
# audio I/O helpers: tests/oracle/official.py stubs them. librosa (with soundfile) is
# installed: the official speaker-encoder mel uses librosa's slaney filterbank, and the
# clone fixtures prove streamvox's own filterbank equal to it.
# transformers brings tokenizers, huggingface-hub, safetensors, numpy, regex, pyyaml.
ORACLE_PKGS=("transformers==4.57.3" "librosa==0.11.0")   # transformers: the version qwen-tts 0.1.1 pins

venv_create "$VENV"
if ! venv_has_pins "$VENV" "torch==$TORCH_VERSION" "${ORACLE_PKGS[@]}" "qwen-tts==0.1.1"; then
  echo "oracle-env: installing torch==$TORCH_VERSION (CPU build), transformers 4.57.3, librosa 0.11.0, qwen-tts 0.1.1 --no-deps (about 2 minutes)"
  venv_install_cpu_torch "$VENV"
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" "${ORACLE_PKGS[@]}"
  # The official code itself, without its declared (heavy) dependencies.
  "$VENV/bin/python" -m pip install -q --no-deps "qwen-tts==0.1.1"
fi
echo "oracle-env: venv ready after $(( $(date +%s) - start ))s"

# Fixtures: rewritten only when the fixture scripts changed (or ORACLE_FORCE=1; about a minute).
# (tests/oracle/fixtures.py is the pytest-side reader, not part of the build.)
fixtures_refresh "$VENV" "$OUT" tests/oracle/official.py tests/oracle/randomize.py tests/oracle/make_fixtures.py

# The talker's parity fixtures (tests/fixtures/oracle/talker/) use the same venv; build
# them here too so dev-setup / CI get every oracle fixture from one entry point.
if [ -f scripts/oracle-talker-fixtures.sh ]; then
  bash scripts/oracle-talker-fixtures.sh
fi
# The voice-clone / voice-design fixtures (tests/fixtures/oracle/clone/), same venv.
if [ -f scripts/oracle-clone-fixtures.sh ]; then
  bash scripts/oracle-clone-fixtures.sh
fi
echo "oracle-env: done in $(( $(date +%s) - start ))s"
