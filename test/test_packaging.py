"""The runtime wheel: `pip install sglang-tokendance` ships the server extension alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_runtime_wheel_ships_the_extension_without_benchmarks_or_demo(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(ROOT / "python", source / "python", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], check=True)
    names = zipfile.ZipFile(next((tmp_path / "dist").glob("sglang_tokendance-*.whl"))).namelist()
    assert {"sglang_tokendance/srt/plugin.py", "sglang_tokendance/core/blend.py", "sglang_tokendance/launch_server.py",
            "sglang_tokendance/_sgl_kernel_fallback/sgl_kernel/__init__.py"} <= set(names)
    shipped = [n for n in names if n.startswith(("sglang_tokendance/bench", "sglang_tokendance/demo"))]
    assert shipped == []
    # from the checkout (the editable install) the benchmarks still run as modules
    assert (ROOT / "python/sglang_tokendance/bench_group_chat.py").exists()
    __import__("sglang_tokendance.bench_group_chat")
