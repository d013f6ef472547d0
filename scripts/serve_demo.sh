#!/usr/bin/env bash
# The main job: set up (idempotent), start the TokenDance server on the default model
# (SmolLM2-135M-Instruct), answer one request, and stop. Extra arguments go to the launcher.
# Keep a server running instead with:
#   .venv/bin/python -m sglang_tokendance.launch_server --port 30000
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TOKENDANCE_VENV:-$ROOT/.venv}
PORT=${PORT:-30000}
bash "$ROOT/scripts/setup_cpu.sh"
LOG=$(mktemp -t tokendance-server-XXXX.log)
start=$(date +%s)
setsid "$VENV/bin/python" -m sglang_tokendance.launch_server --host 127.0.0.1 --port "$PORT" "$@" >"$LOG" 2>&1 &
pid=$!
trap 'kill -TERM -- -$pid 2>/dev/null || true; sleep 2; kill -KILL -- -$pid 2>/dev/null || true' EXIT
echo "[demo] starting the server (log: $LOG)"
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  if ! kill -0 "$pid" 2>/dev/null; then echo "[demo] server exited:"; tail -30 "$LOG"; exit 1; fi
  if [ $(( $(date +%s) - start )) -gt 600 ]; then echo "[demo] server not up after 600 s"; tail -30 "$LOG"; exit 1; fi
  sleep 1
done
echo "[demo] server up in $(( $(date +%s) - start )) s"
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "default", "temperature": 0, "max_tokens": 32,
  "messages": [{"role": "user", "content": "What is the capital of France?"}]
}' | "$VENV/bin/python" -c 'import json, sys; r = json.load(sys.stdin); print("[demo] Q: What is the capital of France?"); print("[demo] A:", r["choices"][0]["message"]["content"])'
