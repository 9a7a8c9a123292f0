#!/usr/bin/env bash
# Build .venv-agents: the voice-agent SDKs (ElevenLabs, Cartesia, Deepgram, LiveKit Agents plugins, Pipecat)
# that the dialect tests run, unmodified, as subprocess clients against a live streamvox.
#
# Why a separate venv: these SDKs pin their own aiohttp / websockets / pydantic / protobuf
# and pull native wheels (livekit's rtc library); none of that may move the project's .venv.
# They are test clients, never runtime dependencies.
#
# Idempotent: an existing venv whose packages match the pins is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_TAG=agents-env
source scripts/lib/venv.sh
VENV=.venv-agents
PKGS=(
  "elevenlabs==2.78.0"
  "cartesia==4.2.0"
  "deepgram-sdk==7.16.0"
  "livekit-agents==1.8.9"
  "livekit-plugins-elevenlabs==1.8.9"
  "livekit-plugins-cartesia==1.8.9"
  "livekit-plugins-deepgram==1.8.9"
  "pipecat-ai[elevenlabs,cartesia,deepgram]==1.14.0"
)
start=$(date +%s)
venv_create "$VENV"
if venv_has_pins "$VENV" "${PKGS[@]}"; then
  echo "agents-env: $VENV is up to date"
else
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "${PKGS[@]}"
fi
echo "agents-env: done in $(( $(date +%s) - start )) s"
