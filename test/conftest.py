"""Shared fixtures. Slow tests start real SGLang servers on SmolLM2 (one per module)."""

from __future__ import annotations

import pytest
import requests

from sglang_tokendance.model_store import prepared_default_model


@pytest.fixture(scope="session")
def smollm2_path():
    return prepared_default_model()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """HF transformers' model and tokenizer on the same fp32 weights SGLang serves."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_path)


def hf_greedy(hf_model_and_tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    """HF greedy continuation ids, cut after the first EOS as SGLang stops there."""
    import torch

    model, tokenizer = hf_model_and_tokenizer
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    new = out[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, tok in enumerate(new):
        if tok in eos:
            return new[: i + 1]
    return new


def generate(url: str, text, max_new_tokens: int = 16, **extra) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **extra}
    r = requests.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()
