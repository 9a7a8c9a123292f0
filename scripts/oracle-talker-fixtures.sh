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
if [ ! -x .venv-oracle/bin/python ]; then
  bash scripts/oracle-env.sh
fi
# Same list as tests/oracle/talker_fixtures.py (TALKER_FIXTURE_SCRIPTS).
fixtures_refresh .venv-oracle tests/fixtures/oracle/talker tests/oracle/official.py tests/oracle/randomize.py \
  tests/oracle/make_fixtures.py tests/oracle/make_talker_fixtures.py
