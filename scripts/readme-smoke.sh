#!/usr/bin/env bash
# The newcomer's path, exactly as the README prints it: run README command 1 (install +
# `streamvox serve` on the embedded default: random weights offline), wait for /readyz (within a minute of the
# command starting), then `streamvox say` against it must write a valid WAV, and
# SIGTERM must stop it with exit code 0. Used by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=$(awk '/^```bash/{f=1; next} f && /^```/{exit} f' README.md | grep -v '^[[:space:]]*#' | grep -v '^[[:space:]]*$' | head -n 1)
[ -n "$cmd" ] || { echo "readme-smoke: no command 1 in README.md"; exit 1; }
work=$(mktemp -d)
log="$work/serve.log"
echo "readme-smoke: running README command 1: $cmd"
# Only the port (ephemeral, logged), the data dir and the model cache come from the environment.
# With no model named, serve looks for the default Qwen3-TTS release (cache, then the hub) and
# otherwise starts on the built-in random preset in one log line. The smoke pins that fallback:
# HF_HUB_OFFLINE=1 and an empty HF_HOME, so a CI machine that can reach huggingface.co (or has
# the model cached) does not spend the minute fetching and loading gigabytes. The hub path itself is
# tested against a local hub by tests/test_model_hub.py.
HF_HUB_OFFLINE=1 HF_HOME="$work/hf" STREAMVOX_PORT=0 STREAMVOX_DATA_DIR="$work/data" \
  setsid bash -c "$cmd" >"$log" 2>&1 &
pid=$!
cleanup() { kill -TERM -- -"$pid" 2>/dev/null || true; }
trap cleanup EXIT
start=$(date +%s)
url=""
while [ $(( $(date +%s) - start )) -lt 60 ]; do
  url=$(grep -o 'listening on http://[0-9.:]*' "$log" | head -n 1 | sed 's/listening on //') || true
  if [ -n "$url" ] && .venv/bin/python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('$url/readyz').status != 200)" 2>/dev/null; then
    break
  fi
  url=""
  sleep 1
done
if [ -z "$url" ]; then
  echo "readme-smoke: /readyz not reached within 60 s of README command 1"; tail -n 30 "$log"; exit 1
fi
echo "readme-smoke: ready at $url after $(( $(date +%s) - start ))s"
.venv/bin/streamvox say "Hello from the README. The newcomer path works." --url "$url" --out "$work/say.wav"
.venv/bin/python - "$work/say.wav" <<'PY'
import sys
import numpy as np
import soundfile as sf
audio, rate = sf.read(sys.argv[1], dtype="float32")
assert rate == 24000, rate
assert len(audio) > 0 and len(audio) % 1920 == 0, len(audio)
assert np.isfinite(audio).all() and np.abs(audio).max() > 1e-3
print(f"readme-smoke: valid WAV, {len(audio) / rate:.2f} s at {rate} Hz")
PY
kill -TERM -- -"$pid"
trap - EXIT
status=0
wait "$pid" || status=$?
[ "$status" -eq 0 ] || { echo "readme-smoke: serve exited $status after SIGTERM"; tail -n 20 "$log"; exit 1; }
echo "readme-smoke: serve drained and exited 0"
