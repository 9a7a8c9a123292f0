#!/usr/bin/env bash
# Write the voice-clone / voice-design parity fixtures (tests/fixtures/oracle/clone/) with the
# OFFICIAL qwen-tts code in .venv-oracle: random Base, VoiceDesign and 1.7B-style CustomVoice
# checkpoints in the released layout + generate_voice_clone / generate_voice_design /
# generate_custom_voice references, and the official log-mel, x-vector and reference codes.
#
# Needs the oracle venv with librosa (scripts/oracle-env.sh installs it: the official mel uses
# librosa's filterbank). Idempotent: rebuilt only when the fixture scripts changed
# (stamp = their sha256). Env: ORACLE_FORCE=1 rebuilds. About 20 s.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_TAG=oracle-clone-fixtures
source scripts/lib/venv.sh
if [ ! -x .venv-oracle/bin/python ]; then
  bash scripts/oracle-env.sh
fi
# Same list as tests/oracle/clone_fixtures.py (CLONE_FIXTURE_SCRIPTS).
fixtures_refresh .venv-oracle tests/fixtures/oracle/clone tests/oracle/official.py tests/oracle/randomize.py \
  tests/oracle/make_fixtures.py tests/oracle/make_talker_fixtures.py tests/oracle/make_clone_fixtures.py
