#!/usr/bin/env bash
# The main job: set up (idempotent), then show what TokenDance is for on the default model
# (SmolLM2-135M-Instruct): a short All-Gather simulation (4 agents, 2 rounds) against a
# TokenDance server and against the same server with --disable-tokendance, one table per
# round and a sample answer from each, plus a one-question chat on each server (the smoke
# check). A few minutes on 2 CPU cores. Extra arguments go to `python -m sglang_tokendance.demo`
# (--num-agents, --num-rounds, --max-new-tokens, --seed, --port).
# Keep a server running instead with:
#   .venv/bin/python -m sglang_tokendance.launch_server --port 30000
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TOKENDANCE_VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup_cpu.sh"
exec "$VENV/bin/python" -m sglang_tokendance.demo "$@"
