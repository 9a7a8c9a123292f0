# Shared by the scripts that build a virtualenv (the project's, the oracles', the agent SDKs')
# and the fixtures written with one. Sourced, never run: `source scripts/lib/venv.sh` from the
# repository root, with LOG_TAG set to the script's name (the prefix of every message).
# Env: PYTHON picks the base interpreter; STREAMVOX_TORCH_VERSION / STREAMVOX_TORCH_INDEX the
# torch pin and where its build comes from; ORACLE_FORCE=1 rebuilds fixtures that look current.

TORCH_VERSION=${STREAMVOX_TORCH_VERSION:-2.13.0}

# venv_create VENV: a fresh virtualenv at VENV unless one is there already.
venv_create() {
  if [ ! -x "$1/bin/python" ]; then
    echo "$LOG_TAG: creating $1"
    "${PYTHON:-python3}" -m venv "$1"
  fi
}

# venv_has_pins VENV NAME==VERSION...: true when VENV holds every one of these distributions at
# exactly that version (extras such as "[cartesia]" and a local build tag such as "+cpu" aside).
venv_has_pins() {
  local venv=$1
  shift
  "$venv/bin/python" - "$@" <<'PYEOF' 2>/dev/null
import importlib.metadata as md
import re
import sys

for spec in sys.argv[1:]:
    name, version = re.sub(r"\[.*\]", "", spec).split("==")
    if md.version(name).split("+")[0] != version:
        raise SystemExit(1)
PYEOF
}

# venv_install_cpu_torch VENV: the pinned torch alone, never a bare `torch`, from PyTorch's CPU
# index (PyPI's Linux wheel is the CUDA build and pulls GBs of nvidia-* wheels; a local wheel
# folder in pip's configuration still wins). --no-deps: torch's own plain-Python dependencies come
# from PyPI with the caller's next install, so an unreachable index is asked once, not per package.
venv_install_cpu_torch() {
  "$1/bin/python" -m pip install -q "torch==$TORCH_VERSION" --no-deps \
    --index-url "${STREAMVOX_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
}

# fixtures_refresh VENV OUT SCRIPT...: the fixtures in OUT, written by the last SCRIPT (run as
# `VENV/bin/python SCRIPT OUT`) with the others it imports. OUT/STAMP holds the sha256 of all the
# SCRIPTs in this order (the tests compute the same to tell stale fixtures): a matching stamp keeps
# OUT unless ORACLE_FORCE=1. The stamp is written only once the build succeeded, so a failed build
# is redone next time. Single-threaded torch keeps the 2-core CI box usable and the numerics
# reproducible.
fixtures_refresh() {
  local venv=$1 out=$2 stamp
  shift 2
  stamp=$(cat "$@" | sha256sum | cut -d' ' -f1)
  if [ "${ORACLE_FORCE:-0}" != "1" ] && [ -f "$out/STAMP" ] && [ "$(cat "$out/STAMP")" = "$stamp" ]; then
    echo "$LOG_TAG: fixtures up to date ($out)"
    return 0
  fi
  echo "$LOG_TAG: writing $out with ${!#}"
  rm -rf "$out"
  mkdir -p "$out"
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TRANSFORMERS_VERBOSITY=error "$venv/bin/python" "${!#}" "$out"
  echo "$stamp" > "$out/STAMP"
  echo "$LOG_TAG: fixtures written to $out"
}
