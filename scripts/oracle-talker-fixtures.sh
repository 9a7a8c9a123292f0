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
LOG_TAG=oracle-talker-fixtures
source scripts/lib/venv.sh
VENV=.venv-oracle
OUT=tests/fixtures/oracle/talker
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  bash scripts/oracle-env.sh
fi

# Same list as tests/oracle/talker_fixtures.py (TALKER_FIXTURE_SCRIPTS).
if fixtures_current "$OUT" tests/oracle/official.py tests/oracle/randomize.py tests/oracle/make_fixtures.py \
    tests/oracle/make_talker_fixtures.py; then
  echo "oracle-talker-fixtures: up to date ($OUT)"
  exit 0
fi
fixtures_write "$OUT" "$VENV/bin/python" tests/oracle/make_talker_fixtures.py
echo "oracle-talker-fixtures: written to $OUT in $(( $(date +%s) - start ))s"
