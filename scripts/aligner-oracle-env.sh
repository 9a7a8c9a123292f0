#!/usr/bin/env bash
# Build the forced-aligner *oracle*: a virtualenv (.venv-aligner) holding the official qwen-asr
# code, then write the aligner parity fixtures with it (tests/fixtures/aligner/).
#
# Why its own venv: qwen-asr 0.0.6 pins transformers==4.57.6 (the TTS oracle pins 4.57.3) and
# declares gradio, flask, vllm extras, accelerate, ... It is installed --no-deps next to exactly
# what qwen_asr.inference.qwen3_forced_aligner imports: transformers, librosa + soundfile
# (qwen_asr.inference.utils), nagisa (Japanese words; brings its DyNet wheels), soynlp (Korean
# words; --no-deps, plus the psutil it imports).
#
# Idempotent: the venv is reused when its packages are right; the fixtures are rebuilt only when
# the fixture script changed (stamp = its sha256). Env: ORACLE_FORCE=1 rebuilds; PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_TAG=aligner-oracle-env
source scripts/lib/venv.sh
VENV=.venv-aligner
OUT=tests/fixtures/aligner
start=$(date +%s)

venv_create "$VENV"
if ! venv_has_pins "$VENV" "torch==$TORCH_VERSION" "transformers==4.57.6" "qwen-asr==0.0.6" "librosa==0.11.0" \
    "nagisa==0.2.11" "soynlp==0.0.493"; then
  echo "aligner-oracle-env: installing torch==$TORCH_VERSION (CPU), transformers 4.57.6, librosa, nagisa, soynlp, qwen-asr 0.0.6 --no-deps"
  venv_install_cpu_torch "$VENV" || echo "aligner-oracle-env: the torch index did not answer; trying pip's configured sources"
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" "transformers==4.57.6" "librosa==0.11.0" soundfile psutil "nagisa==0.2.11"
  "$VENV/bin/python" -m pip install -q --no-deps "soynlp==0.0.493" "qwen-asr==0.0.6"
fi
echo "aligner-oracle-env: venv ready after $(( $(date +%s) - start ))s"

fixtures_refresh "$VENV" "$OUT" tests/oracle/make_aligner_fixtures.py
echo "aligner-oracle-env: done in $(( $(date +%s) - start ))s"
