"""Running SGLang 0.5.23 on a machine without CUDA.

SGLang's CPU engine needs SGLANG_USE_CPU_ENGINE=1 before its modules are imported, and then
imports `sgl_kernel` in every process it spawns, before any plugin loads. No CPU build of
sgl-kernel exists on the package index, so when the real one cannot be loaded we put the
folder holding our torch fallback on PYTHONPATH: the environment is the only route into the
spawned scheduler. With CUDA present nothing here changes anything.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

FALLBACK_ROOT = Path(__file__).resolve().parent / "_sgl_kernel_fallback"

# SGLang server arguments (ServerArgs field names) that make the CPU path work and fast.
CPU_SERVER_DEFAULTS: dict[str, object] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "disable_cuda_graph": True,
    "dtype": "float32",  # fp32 is ~6x faster than bf16 on these CPUs
    "sleep_on_idle": True,  # otherwise the idle scheduler spins a whole core
    # SGLang would size the KV pool at ~70% of host memory (14 GB, 20 s to allocate here);
    # 32k tokens of SmolLM2 KV take 1.5 GB.
    "max_total_tokens": 32768,
}


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def real_sgl_kernel_loads() -> bool:
    """Whether an installed sgl_kernel imports (probed in a child: a failed import of a CUDA
    build can leave half-initialised state behind in this process)."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return False
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run(
        [sys.executable, "-c", "import sgl_kernel"], env=env, capture_output=True, timeout=300
    )
    return probe.returncode == 0


def fallback_active() -> bool:
    return str(FALLBACK_ROOT) in os.environ.get("PYTHONPATH", "").split(os.pathsep)


def install_sgl_kernel_fallback() -> None:
    """Make the fallback `sgl_kernel` importable here and in every process spawned later."""
    root = str(FALLBACK_ROOT)
    if not fallback_active():
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    if root not in sys.path:
        sys.path.insert(0, root)


def prepare_process() -> bool:
    """Set up this process (and its future children) for SGLang; True on the CPU path.

    Call before SGLang's runtime modules are imported: several decide at import time.
    """
    if cuda_available():
        return False
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    if not fallback_active() and not real_sgl_kernel_loads():
        install_sgl_kernel_fallback()
    return True
