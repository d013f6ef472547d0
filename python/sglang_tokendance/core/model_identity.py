"""The identity of a served model, used as the salt of every segment hash.

Two segments share KV only if the same weights, config and dtypes produced it, so the salt is
a digest of config.json, every weight file's sha256, the dtype and the KV-cache dtype.
Checksums of large weight files are cached by (path, size, mtime) so a restart does not
re-read gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def model_identity(config_path: Path, weight_checksums: Iterable[str], dtype: str, kv_cache_dtype: str) -> bytes:
    digest = hashlib.blake2b(digest_size=32)
    digest.update(Path(config_path).read_bytes())
    for checksum in sorted(weight_checksums):
        digest.update(checksum.encode())
    digest.update(json.dumps([dtype, kv_cache_dtype]).encode())
    return digest.digest()


def weight_checksums(model_dir: Path, cache_file: Path) -> list[str]:
    """sha256 of each weight file in `model_dir`, memoised in `cache_file` (JSON)."""
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    sums, changed = [], False
    for path in sorted(p for p in Path(model_dir).iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        stat = path.stat()
        key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        if key not in cache:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    digest.update(chunk)
            cache[key], changed = digest.hexdigest(), True
        sums.append(cache[key])
    if changed:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(cache_file)
    return sums
