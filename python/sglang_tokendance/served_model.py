"""The served model's identity, computed once at start and handed to every process.

Segment hashes are salted with the model's identity (config, weight checksums, dtypes), so
KV computed by other weights is never reused. Checksumming weights reads every weight file:
the launcher and Engine do it once, before SGLang starts, and put the salt in the
environment that SGLang's spawned processes (tokenizer manager, scheduler) inherit -- never
lazily on the HTTP event loop. A hub id resolves to its snapshot in the local Hugging Face
cache; a model whose files are not on disk is refused at start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sglang_tokendance.core.model_identity import model_identity, weight_checksums
from sglang_tokendance.model_store import tokendance_home

SALT_ENV = "SGLANG_TOKENDANCE_MODEL_SALT"
ROPE_KEYS = ("rope_parameters", "rope_scaling")  # core/rope reads the first it finds


class ModelNotLocalError(RuntimeError):
    """The model's files are not on this machine."""


def local_model_dir(model_path: str, revision: str | None = None) -> Path:
    """The folder holding the model's config.json: `model_path` itself, or a hub id's
    snapshot in the local Hugging Face cache (never downloaded here)."""
    path = Path(model_path).expanduser()
    if (path / "config.json").is_file():
        return path
    if not path.exists():
        try:
            from huggingface_hub import snapshot_download

            snapshot = Path(snapshot_download(model_path, revision=revision, local_files_only=True))
        except Exception:  # not a repo id, or not in the cache
            snapshot = None
        if snapshot is not None and (snapshot / "config.json").is_file():
            return snapshot
    raise ModelNotLocalError(
        f"--model-path {model_path!r} is neither a local model folder nor a model in the local Hugging Face "
        "cache; TokenDance salts shared KV with the weights' checksums, so download it first "
        f"(huggingface-cli download {model_path}) or pass its folder")


def model_salt(model_path: str, revision: str | None, dtype: str, kv_cache_dtype: str) -> bytes:
    model_dir = local_model_dir(model_path, revision)
    sums = weight_checksums(model_dir, tokendance_home() / "weight_checksums.json")
    return model_identity(model_dir / "config.json", sums, str(dtype), str(kv_cache_dtype))


def served_config(model_path: str, revision: str | None = None, model_override_args: str | None = None) -> dict:
    """The config SGLang serves: config.json with `--json-model-override-args` applied as
    SGLang's get_config applies it (a dict given for a dict is merged into it, shallowly; under
    transformers 5 `rope_scaling` and `rope_parameters` name one dict)."""
    config = json.loads((local_model_dir(model_path, revision) / "config.json").read_text())
    for key, value in json.loads(model_override_args or "{}").items():
        if key in ROPE_KEYS:
            key = next((k for k in ROPE_KEYS if isinstance(config.get(k), dict)), key)
        current = config.get(key)
        config[key] = {**current, **value} if isinstance(value, dict) and isinstance(current, dict) else value
    return config


def check_rope(model_path: str, revision: str | None = None, model_override_args: str | None = None) -> None:
    """Refuse, in one line, a model whose RoPE TokenDance cannot move between positions
    (longrope, mrope, ...): cached K is re-rotated to every reader's offset, so the rotation
    must be exactly the one SGLang's model applies (srt/kv_copy.serving_rope_spec), overrides
    included."""
    from sglang_tokendance.server_args import TokenDanceArgsError
    from sglang_tokendance.srt.kv_copy import serving_rope_spec

    try:
        serving_rope_spec(served_config(model_path, revision, model_override_args))
    except ValueError as e:
        where = "--json-model-override-args" if model_override_args not in (None, "", "{}") else "--model-path"
        raise TokenDanceArgsError(where, f"{model_path}: {e}, so TokenDance cannot reuse its KV at "
                                  "other positions; pass --disable-tokendance to serve it with SGLang's own "
                                  "caching") from None


def export_model_salt(model_path: str, revision: str | None = None, dtype: str = "auto",
                      kv_cache_dtype: str = "auto") -> bytes:
    """Compute the salt of the model about to be served and hand it to spawned processes."""
    salt = model_salt(model_path, revision, dtype, kv_cache_dtype)
    os.environ[SALT_ENV] = salt.hex()
    return salt


def model_salt_from_env() -> bytes:
    raw = os.environ.get(SALT_ENV)
    if not raw:
        raise RuntimeError(f"{SALT_ENV} is not set: start TokenDance through sglang_tokendance.launch_server "
                           "or sglang_tokendance.Engine, which compute the model's identity at start")
    return bytes.fromhex(raw)
