#!/usr/bin/env bash
# Set up (idempotent), then run the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/run_tests.sh -m "not slow"` for the fast tests alone.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TOKENDANCE_VENV:-$ROOT/.venv}
bash "$ROOT/scripts/setup_cpu.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
