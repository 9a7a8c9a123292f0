#!/usr/bin/env bash
# Write the talker parity fixtures (tests/fixtures/oracle/talker/) with the OFFICIAL
# qwen-tts code in .venv-oracle: random custom-voice checkpoints in the released layout
# (text-tokenizer files included) + generate_custom_voice references.
#
# Needs the oracle venv (scripts/oracle-env.sh builds it; run here if it is missing).
# Idempotent: rebuilt only when the fixture scripts changed (stamp = their sha256).
# Env: ORACLE_FORCE=1 rebuilds. Call it after scripts/oracle-env.sh (which wipes
# tests/fixtures/oracle/ when its own fixtures change).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-oracle
OUT=tests/fixtures/oracle/talker
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  bash scripts/oracle-env.sh
fi

# Same list as tests/oracle/talker_fixtures.py (TALKER_FIXTURE_SCRIPTS).
SCRIPTS=(tests/oracle/official.py tests/oracle/randomize.py tests/oracle/make_fixtures.py
         tests/oracle/make_talker_fixtures.py)
stamp=$(cat "${SCRIPTS[@]}" | sha256sum | cut -d' ' -f1)
if [ "${ORACLE_FORCE:-0}" != "1" ] && [ -f "$OUT/STAMP" ] && [ "$(cat "$OUT/STAMP")" = "$stamp" ]; then
  echo "oracle-talker-fixtures: up to date ($OUT)"
  exit 0
fi
rm -rf "$OUT"
mkdir -p "$OUT"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TRANSFORMERS_VERBOSITY=error "$VENV/bin/python" \
  tests/oracle/make_talker_fixtures.py "$OUT"
echo "$stamp" > "$OUT/STAMP"
echo "oracle-talker-fixtures: written to $OUT in $(( $(date +%s) - start ))s"
