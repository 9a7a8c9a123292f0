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
PY=${PYTHON:-python3}
VENV=.venv-aligner
OUT=tests/fixtures/aligner
TORCH_VERSION=${STREAMVOX_TORCH_VERSION:-2.13.0}
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  echo "aligner-oracle-env: creating $VENV"
  "$PY" -m venv "$VENV"
fi
OPY="$VENV/bin/python"
if ! "$OPY" - "$TORCH_VERSION" <<'PYEOF' 2>/dev/null
import sys, importlib.metadata as md
want = {"torch": sys.argv[1], "transformers": "4.57.6", "qwen-asr": "0.0.6", "librosa": "0.11.0",
        "nagisa": "0.2.11", "soynlp": "0.0.493"}
for name, version in want.items():
    if md.version(name).split("+")[0] != version:
        raise SystemExit(1)
PYEOF
then
  echo "aligner-oracle-env: installing torch==$TORCH_VERSION (CPU), transformers 4.57.6, librosa, nagisa, soynlp, qwen-asr 0.0.6 --no-deps"
  "$OPY" -m pip install -q "torch==$TORCH_VERSION" --no-deps --index-url "${STREAMVOX_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
    || echo "aligner-oracle-env: the torch index did not answer; trying pip's configured sources"
  "$OPY" -m pip install -q "torch==$TORCH_VERSION" "transformers==4.57.6" "librosa==0.11.0" soundfile psutil "nagisa==0.2.11"
  "$OPY" -m pip install -q --no-deps "soynlp==0.0.493" "qwen-asr==0.0.6"
fi
echo "aligner-oracle-env: venv ready after $(( $(date +%s) - start ))s"

stamp=$(cat tests/oracle/make_aligner_fixtures.py | sha256sum | cut -d' ' -f1)
if [ "${ORACLE_FORCE:-0}" != "1" ] && [ -f "$OUT/STAMP" ] && [ "$(cat "$OUT/STAMP")" = "$stamp" ]; then
  echo "aligner-oracle-env: fixtures up to date ($OUT)"
else
  rm -rf "$OUT"
  mkdir -p "$OUT"
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TRANSFORMERS_VERBOSITY=error "$OPY" tests/oracle/make_aligner_fixtures.py "$OUT"
  echo "$stamp" > "$OUT/STAMP"
  echo "aligner-oracle-env: fixtures written to $OUT"
fi
echo "aligner-oracle-env: done in $(( $(date +%s) - start ))s"
