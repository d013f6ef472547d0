"""RoPE rotate/unrotate/rerotate: round-trip invariants per variant, and agreement with HF transformers.

Tolerances: our angles are float64 and the rotation float32, so round trips only see
float32 rounding of cos/sin and products (~1e-6 on unit-variance K) -> ``ROUND_TRIP_ATOL``.
HF computes angles ``position * inv_freq`` in float32, off by up to half an ulp of the
angle (~``position * 6e-8`` rad), so HF agreement is checked against a per-token bound
that grows with position (``_assert_close_to_hf``); inverse frequencies must match bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglang_tokendance.core.rope import (
    RopeScaling,
    RopeSpec,
    attention_scaling,
    cos_sin,
    inv_freq,
    rerotate,
    rotate,
    unrotate,
)

ROUND_TRIP_ATOL = 1e-5
MAX_POS = 8192
SMOLLM2_CONFIG = Path("/root/.cache/sglang_tokendance/models/SmolLM2-135M-Instruct/config.json")

# Rope-relevant parts of real config.json files (plus synthetic linear/dynamic ones).
VARIANTS: dict[str, RopeSpec] = {
    "smollm2": RopeSpec.from_hf_config(
        {"hidden_size": 576, "num_attention_heads": 9, "head_dim": 64, "max_position_embeddings": 8192,
         "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    ),
    "llama3.1": RopeSpec.from_hf_config(
        {"hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 131072, "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}}
    ),
    "qwen2.5": RopeSpec.from_hf_config(
        {"hidden_size": 896, "num_attention_heads": 14, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
         "rope_scaling": None}
    ),
    "qwen2.5-yarn": RopeSpec.from_hf_config(
        {"hidden_size": 3584, "num_attention_heads": 28, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    ),
    "qwen3": RopeSpec.from_hf_config(
        {"hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128, "max_position_embeddings": 40960,
         "rope_theta": 1000000, "rope_scaling": None}
    ),
    "mistral-v0.2": RopeSpec.from_hf_config(
        {"hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 32768, "rope_theta": 1000000.0}
    ),
    "mistral-v0.1": RopeSpec.from_hf_config(
        {"hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 32768, "rope_theta": 10000.0}
    ),
    "linear": RopeSpec(64, 64, 10000.0, scaling=RopeScaling("linear", factor=4.0)),
    "dynamic": RopeSpec(
        64, 64, 10000.0, scaling=RopeScaling("dynamic", factor=2.0, max_position_embeddings=2048, seq_len=MAX_POS)
    ),
    "partial": RopeSpec.from_hf_config(
        {"hidden_size": 2048, "num_attention_heads": 32, "partial_rotary_factor": 0.5,
         "max_position_embeddings": 2048, "rope_theta": 10000.0}
    ),
    "interleaved": RopeSpec(64, 64, 10000.0, layout="interleaved"),
    "interleaved-partial-yarn": RopeSpec(
        256, 64, 10000.0, "interleaved", RopeScaling("yarn", factor=4.0, original_max_position_embeddings=2048)
    ),
}


def _k(spec: RopeSpec, tokens: int = 64, heads: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random raw K [tokens, heads, head_dim] and two random position vectors in [0, MAX_POS)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, heads, spec.head_dim, generator=g)
    return k, torch.randint(0, MAX_POS, (tokens,), generator=g), torch.randint(0, MAX_POS, (tokens,), generator=g)


@pytest.mark.parametrize("name", VARIANTS)
def test_round_trips(name: str) -> None:
    spec = VARIANTS[name]
    k, p0, p1 = _k(spec)
    at_p0 = rotate(k, p0, spec)
    torch.testing.assert_close(unrotate(at_p0, p0, spec), k, atol=ROUND_TRIP_ATOL, rtol=0)
    torch.testing.assert_close(rerotate(at_p0, p0, p1, spec), rotate(k, p1, spec), atol=ROUND_TRIP_ATOL, rtol=0)
    # rotated dims keep their norm times the attention factor; the rest pass through untouched
    r = spec.rotary_dim
    torch.testing.assert_close(
        at_p0[..., :r].norm(dim=-1), k[..., :r].norm(dim=-1) * attention_scaling(spec), atol=ROUND_TRIP_ATOL, rtol=0
    )
    assert torch.equal(at_p0[..., r:], k[..., r:])


def test_yarn_factor_is_carried_once() -> None:
    spec = VARIANTS["qwen2.5-yarn"]
    scale = attention_scaling(spec)
    assert scale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    k, p0, _ = _k(spec)
    zero = torch.zeros_like(p0)
    # rotation at position 0 is the identity, so what remains is exactly the factor
    torch.testing.assert_close(rotate(k, zero, spec), k * scale, atol=ROUND_TRIP_ATOL, rtol=0)
    # a delta rotation adds no factor: moving to 0 and back leaves K as rotate() made it
    at_p0 = rotate(k, p0, spec)
    torch.testing.assert_close(rerotate(at_p0, p0, zero, spec), k * scale, atol=ROUND_TRIP_ATOL, rtol=0)
    cos, sin = cos_sin(spec, p0)
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, scale**2))


def test_negative_deltas() -> None:
    spec = VARIANTS["llama3.1"]
    k, _, _ = _k(spec)
    far = torch.arange(5000, 5000 + k.shape[0])
    near = torch.arange(k.shape[0])
    moved = rerotate(rotate(k, far, spec), far, near, spec)
    torch.testing.assert_close(moved, rotate(k, near, spec), atol=ROUND_TRIP_ATOL, rtol=0)
    torch.testing.assert_close(rerotate(moved, near, far, spec), rotate(k, far, spec), atol=ROUND_TRIP_ATOL, rtol=0)


def test_dtype_and_shape_checks() -> None:
    spec = VARIANTS["smollm2"]
    k, p0, _ = _k(spec)
    assert rotate(k.bfloat16(), p0, spec).dtype == torch.bfloat16
    assert rotate(k[:, 0], p0, spec).shape == k[:, 0].shape  # [tokens, head_dim] also works
    with pytest.raises(ValueError, match="tokens"):
        rotate(k, p0[:-1], spec)
    with pytest.raises(ValueError, match="shape"):
        rerotate(k, p0, p0[:-1], spec)


def test_dynamic_ntk_depends_on_seq_len() -> None:
    plain = inv_freq(RopeSpec(64, 64, 10000.0))
    short = RopeScaling("dynamic", factor=2.0, max_position_embeddings=2048, seq_len=1000)
    assert torch.equal(inv_freq(RopeSpec(64, 64, 10000.0, scaling=short)), plain)
    assert torch.all(inv_freq(VARIANTS["dynamic"])[1:] < plain[1:])


def test_from_hf_config_reads_smollm2() -> None:
    if not SMOLLM2_CONFIG.exists():
        pytest.skip("SmolLM2 config not downloaded")
    spec = RopeSpec.from_hf_config(json.loads(SMOLLM2_CONFIG.read_text()))
    assert spec == RopeSpec(head_dim=64, rotary_dim=64, base=100000.0, layout="half")
    assert spec == VARIANTS["smollm2"]


@pytest.mark.parametrize(
    "rope_scaling, match",
    [
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "longrope"),
        ({"type": "mrope", "mrope_section": [16, 24, 24]}, "mrope"),
        ({"rope_type": "linear"}, "factor"),
    ],
)
def test_unsupported_configs_raise(rope_scaling: dict, match: str) -> None:
    config = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128, "rope_scaling": rope_scaling}
    with pytest.raises(ValueError, match=match):
        RopeSpec.from_hf_config(config)
    with pytest.raises(ValueError, match="unsupported"):
        RopeScaling("su")


# ---- agreement with HF transformers ------------------------------------------------------------

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
# name -> (HF class prefix, config kwargs): tiny sizes, real rope settings.
HF_CASES: dict[str, tuple[str, dict]] = {
    "llama-default": ("Llama", {"hidden_size": 576, "num_attention_heads": 9, "head_dim": 64,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}),
    "llama-llama3": ("Llama", {"hidden_size": 256, "num_attention_heads": 2, "max_position_embeddings": 131072,
                               "rope_parameters": _LLAMA3}),
    "llama-linear": ("Llama", {"hidden_size": 256, "num_attention_heads": 4,
                               "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama-dynamic": ("Llama", {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 1024,
                                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "qwen2-default": ("Qwen2", {"hidden_size": 256, "num_attention_heads": 4,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "qwen2-yarn": ("Qwen2", {"hidden_size": 512, "num_attention_heads": 4, "max_position_embeddings": 32768,
                             "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
                                                 "original_max_position_embeddings": 32768}}),
    "qwen3-default": ("Qwen3", {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 128,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "qwen3-yarn": ("Qwen3", {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 128,
                             "max_position_embeddings": 131072,
                             "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
                                                 "original_max_position_embeddings": 32768}}),
}


def _assert_close_to_hf(ours: torch.Tensor, expected: torch.Tensor, positions: torch.Tensor, k: torch.Tensor) -> None:
    """Per token: HF's float32 angle ``p * f`` (f <= 1) is off by <= 2**-24 * p rad, which moves
    a rotated pair (norm <= sqrt(2) * max|k| * attention factor < 2 * max|k|) by at most that much."""
    bound = positions.double() * 2**-24 * 2 * k.abs().max().item() + ROUND_TRIP_ATOL
    err = (ours - expected).abs().flatten(1).amax(dim=1).double()
    assert torch.all(err <= bound), f"worst excess {(err - bound).max().item():.2e}"


@pytest.mark.parametrize("name", HF_CASES)
def test_matches_hf(name: str) -> None:
    import importlib

    import transformers

    prefix, kwargs = HF_CASES[name]
    module = importlib.import_module(f"transformers.models.{prefix.lower()}.modeling_{prefix.lower()}")
    config = getattr(transformers, f"{prefix}Config")(**kwargs)
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(config)
    # dynamic NTK: HF stretches the base for this forward's max(position)+1 (> max_position_embeddings)
    positions = torch.randint(0, 4 * config.max_position_embeddings if "dynamic" in name else 4096, (48,),
                              generator=torch.Generator().manual_seed(1))
    spec = RopeSpec.from_hf_config(config, seq_len=int(positions.max()) + 1)
    k = torch.randn(48, 3, spec.head_dim, generator=torch.Generator().manual_seed(2))

    k_hf = k.transpose(0, 1)[None]  # [1, heads, tokens, head_dim]
    cos, sin = rotary(k_hf, positions[None])
    _, expected = module.apply_rotary_pos_emb(k_hf, k_hf, cos, sin)
    ours = rotate(k, positions, spec)
    _assert_close_to_hf(ours, expected[0].transpose(0, 1), positions, k)
    assert attention_scaling(spec) == pytest.approx(rotary.attention_scaling)
    assert torch.equal(inv_freq(spec), rotary.inv_freq)  # incl. HF's forward-time dynamic NTK recompute


def test_partial_matches_hf_phi() -> None:
    from transformers import PhiConfig
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding, apply_rotary_pos_emb

    config = PhiConfig(hidden_size=256, num_attention_heads=4, partial_rotary_factor=0.5)
    spec = RopeSpec.from_hf_config(config)
    assert (spec.head_dim, spec.rotary_dim) == (64, 32)
    positions = torch.randint(0, 2048, (32,), generator=torch.Generator().manual_seed(3))
    k = torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(4))
    k_hf = k.transpose(0, 1)[None]
    cos, sin = PhiRotaryEmbedding(config)(k_hf, positions[None])
    _, rotated = apply_rotary_pos_emb(k_hf[..., :32], k_hf[..., :32], cos, sin)  # Phi rotates the first dims only
    expected = torch.cat((rotated, k_hf[..., 32:]), -1)[0].transpose(0, 1)
    _assert_close_to_hf(rotate(k, positions, spec), expected, positions, k)


def test_interleaved_matches_hf_gptj() -> None:
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    spec = RopeSpec(head_dim=256, rotary_dim=64, base=10000.0, layout="interleaved")  # GPT-J-6B
    positions = torch.randint(0, 2048, (32,), generator=torch.Generator().manual_seed(5))
    k = torch.randn(32, 2, 256, generator=torch.Generator().manual_seed(6))
    sincos = create_sinusoidal_positions(2048, 64)[positions][None]
    sin, cos = torch.split(sincos, 32, dim=-1)
    k_hf = k[None]  # GPT-J rotates [batch, tokens, heads, head_dim]
    expected = torch.cat((apply_rotary_pos_emb(k_hf[..., :64], sin, cos), k_hf[..., 64:]), -1)[0]
    _assert_close_to_hf(rotate(k, positions, spec), expected, positions, k)


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
])
def test_the_served_spec_equals_sglangs_rotary_tables(rope_scaling, monkeypatch) -> None:
    """What the server re-rotates cached K with (srt/kv_copy.serving_rope_spec) is the rotation
    SGLang's own `rotary_emb` applies, for every RoPE type we serve: dynamic NTK included,
    whose base SGLang stretches once for max_position_embeddings * factor positions."""
    import sys
    import types

    from sglang.srt.layers.rotary_embedding.factory import get_rope

    # outside SGLang's CPU engine its constructor binds a vllm kernel it never calls here: the tables come first
    kernels = types.ModuleType("vllm._custom_ops")
    kernels.rotary_embedding = None
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", kernels)

    from sglang_tokendance.srt.kv_copy import serving_rope_spec

    config = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 1024, "rope_theta": 10000.0,
              "rope_scaling": rope_scaling}
    spec = serving_rope_spec(config)
    sglang_rope = get_rope(64, 64, 1024, 10000, True, dict(rope_scaling) if rope_scaling else None, torch.float32)
    positions = torch.tensor([0, 1, 7, 300, 1023])
    cos, sin = cos_sin(spec, positions)
    table = sglang_rope.cos_sin_cache[positions].float()
    torch.testing.assert_close(torch.cat([cos, sin], dim=-1), table, atol=2e-4, rtol=0)


def test_a_served_models_own_rotary_table_is_checked_against_the_spec(monkeypatch) -> None:
    """serving_rope_spec given the loaded model (the forest and the attention backend pass it):
    SGLang's own table for the config passes; a model whose rotary_emb rotates otherwise (here:
    another base) is refused, naming the first position that differs."""
    import sys
    import types
    from types import SimpleNamespace

    from sglang.srt.layers.rotary_embedding.factory import get_rope

    kernels = types.ModuleType("vllm._custom_ops")
    kernels.rotary_embedding = None
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", kernels)

    from sglang_tokendance.core.rope import table_mismatch
    from sglang_tokendance.srt.kv_copy import serving_rope_spec

    def model(table: torch.Tensor) -> SimpleNamespace:
        layer = SimpleNamespace(self_attn=SimpleNamespace(rotary_emb=SimpleNamespace(cos_sin_cache=table)))
        return SimpleNamespace(model=SimpleNamespace(layers=[layer], start_layer=0))

    config = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 1024, "rope_theta": 10000.0}
    own = get_rope(64, 64, 1024, 10000, True, None, torch.float32).cos_sin_cache
    other = get_rope(64, 64, 1024, 500000, True, None, torch.float32).cos_sin_cache
    spec = serving_rope_spec(config)
    assert table_mismatch(spec, own) is None and serving_rope_spec(config, model(own)) == spec
    assert table_mismatch(spec, other) == 16  # position 0 has no angle to differ by; every 16th is checked
    assert table_mismatch(spec, own[:, :32]) == 0  # another rotary width
    with pytest.raises(ValueError, match="rotary_emb differs .* at position 16"):
        serving_rope_spec(config, model(other))
    assert serving_rope_spec(config, SimpleNamespace()) == spec  # a model laid out otherwise: not checked
