"""Tiny random-weight Llama, Mistral, Qwen2 and Qwen3 checkpoints for fast tests.

They share SmolLM2's tokenizer (copied from the prepared default model), so the same prompts
and separators work on them, and they load in SGLang and HF transformers like real models.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sglang_tokendance.model_store import prepared_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

TINY_SHAPES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    vocab_size=49152,  # SmolLM2's tokenizer
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=True,
)


TINY_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(arch: str):
    """A transformers config of the named family (one of TINY_ARCHITECTURES) with tiny shapes."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**TINY_SHAPES, rope_theta=100000.0, rms_norm_eps=1e-5)
    if arch == "mistral":
        return MistralConfig(**TINY_SHAPES, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**TINY_SHAPES, rope_theta=1000000.0, rms_norm_eps=1e-6)
    if arch == "qwen3":
        return Qwen3Config(**TINY_SHAPES, rope_theta=1000000.0, rms_norm_eps=1e-6)
    raise ValueError(f"unknown tiny model architecture {arch!r}; use one of {TINY_ARCHITECTURES}")


def tiny_layerwise(arch: str = "llama"):
    """A random-weight tiny model of `arch` (seeded 0, a 512-token vocabulary) in HF
    transformers, driven layer by layer (bench/hf_layerwise): the fast in-process tests' model."""
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_tokendance.bench.hf_layerwise import HFLayerwise

    torch.manual_seed(0)
    config = tiny_config(arch)
    config.vocab_size = 512
    return HFLayerwise(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


def write_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, num_layers: int | None = None) -> Path:
    """Write a random-weight fp32 checkpoint of `arch` to `path` (deterministic in `seed`);
    `num_layers` replaces the tiny depth (4, below TokenDance's default check layer)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    source = prepared_default_model()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    return path
