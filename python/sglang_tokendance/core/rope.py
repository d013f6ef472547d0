"""Rotary position embedding (RoPE) maths for moving cached K to new positions.

Models cache K *after* RoPE, so reusing a block's KV at another offset means
rotating K by the position delta.  This module reproduces the frequencies that
HF transformers (5.x) and SGLang use for Llama (incl. Llama-3.1 "llama3"
scaling), Qwen2/2.5, Qwen3 and Mistral, and offers ``rotate`` / ``unrotate`` /
``rerotate`` on tensors laid out like SGLang's KV pool: ``[tokens, heads,
head_dim]`` (any middle dims broadcast; ``positions`` is ``[tokens]``).

Invariants (exact up to float rounding), for every supported variant::

    unrotate(rotate(k, p, s), p, s)             == k
    rerotate(rotate(k, p0, s), p0, p1, s)       == rotate(k, p1, s)

``rotate`` matches the model, so for YaRN its output carries the attention
factor (cos/sin are multiplied by it, as HF and SGLang do); ``unrotate`` divides
it out and ``rerotate`` is a pure rotation that leaves it untouched.

Precision: inverse frequencies are computed in float32 exactly as HF does (so
they equal the model's); angles are ``position * inv_freq`` in float64 (exact
for any realistic position), and the rotation itself runs in float32.  The
model's own float32 angles differ from these by at most half an ulp of the
angle, i.e. about ``position * 6e-8`` radians.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Layout = Literal["half", "interleaved"]
SUPPORTED_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _check_type(rope_type: str) -> None:
    if rope_type not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_TYPES)}")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling type and its parameters (HF ``rope_parameters`` names).

    Dynamic NTK depends on the sequence length: its base is stretched for
    ``L = max(seq_len, max_position_embeddings)``.  ``seq_len=None`` means
    ``max_position_embeddings`` (no stretch): HF's value at init and for any
    forward pass whose positions stay below ``max_position_embeddings``.  HF
    recomputes it per forward pass as ``max(position_ids) + 1``; SGLang/vLLM
    fix it at ``max_position_embeddings * factor``.  Pass the length the cached
    K was actually written with.
    """

    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float = 1.0  # llama3 (defaults are Llama 3.1's)
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: derived from factor/mscale
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    max_position_embeddings: int | None = None  # dynamic
    seq_len: int | None = None  # dynamic

    def __post_init__(self) -> None:
        _check_type(self.type)
        if self.type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(f"RoPE type {self.type!r} needs original_max_position_embeddings")
        if self.type == "dynamic" and self.max_position_embeddings is None:
            raise ValueError("RoPE type 'dynamic' needs max_position_embeddings")


@dataclass(frozen=True)
class RopeSpec:
    """Everything needed to (re)compute a model's RoPE: only ``x[..., :rotary_dim]`` rotates.

    ``layout="half"`` pairs dim ``i`` with ``i + rotary_dim/2`` (HF ``rotate_half``, SGLang
    ``is_neox_style=True``: Llama, Qwen, Mistral); ``"interleaved"`` pairs ``2i`` with ``2i+1``
    (GPT-J style, SGLang ``is_neox_style=False``).
    """

    head_dim: int
    rotary_dim: int
    base: float
    layout: Layout = "half"
    scaling: RopeScaling = field(default_factory=RopeScaling)

    def __post_init__(self) -> None:
        if self.layout not in ("half", "interleaved"):
            raise ValueError(f"unknown RoPE layout {self.layout!r}; expected 'half' or 'interleaved'")
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")

    @classmethod
    def from_hf_config(cls, config: Any, layout: Layout = "half", seq_len: int | None = None) -> RopeSpec:
        """Build from a transformers config object or a config.json dict (old or new rope keys).

        ``seq_len`` only matters for dynamic NTK (see ``RopeScaling``).  HF checkpoints of the
        supported families all use the half layout; ``layout`` exists for GPT-J-style models.
        """

        def get(key: str) -> Any:
            return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

        params = dict(get("rope_parameters") or get("rope_scaling") or {})
        if any(isinstance(v, Mapping) for v in params.values()):
            raise ValueError("per-layer-type RoPE parameters are not supported")
        if "mrope_section" in params:
            raise ValueError("multimodal RoPE (mrope) is not supported")
        rope_type = params.get("rope_type") or params.get("type") or "default"
        _check_type(rope_type)

        head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
        partial = params.get("partial_rotary_factor") or get("partial_rotary_factor") or 1.0
        max_pos = get("max_position_embeddings")
        original = params.get("original_max_position_embeddings") or get("original_max_position_embeddings")
        factor = params.get("factor")
        if rope_type == "yarn" and factor is None:
            factor = max_pos / (original or max_pos)
        if rope_type != "default" and factor is None:
            raise ValueError(f"RoPE type {rope_type!r} needs a 'factor'")
        optional = {
            k: params[k]
            for k in ("low_freq_factor", "high_freq_factor", "attention_factor", "mscale", "mscale_all_dim", "truncate")
            if params.get(k) is not None
        }
        optional |= {k: params[k] for k in ("beta_fast", "beta_slow") if params.get(k)}  # HF: falsy -> default
        scaling = RopeScaling() if rope_type == "default" else RopeScaling(
            type=rope_type,
            factor=float(factor),
            original_max_position_embeddings=(original or max_pos) if rope_type in ("llama3", "yarn") else None,
            max_position_embeddings=max_pos if rope_type == "dynamic" else None,
            seq_len=seq_len if rope_type == "dynamic" else None,
            **optional,
        )
        base = params.get("rope_theta") or get("rope_theta") or 10000.0
        return cls(head_dim, int(head_dim * partial), float(base), layout, scaling)


def inv_freq(spec: RopeSpec) -> torch.Tensor:
    """Per-pair inverse frequencies [rotary_dim // 2] in float32, bit-for-bit as HF computes them."""
    dim, s = spec.rotary_dim, spec.scaling
    base = spec.base
    if s.type == "dynamic":
        max_pos = s.max_position_embeddings
        length = max(s.seq_len or max_pos, max_pos)
        base = base * ((s.factor * length / max_pos) - (s.factor - 1)) ** (dim / (dim - 2))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = 1.0 / pos_freqs
    if s.type == "linear":
        inv = inv / s.factor
    elif s.type == "llama3":
        old_len = s.original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * inv / s.factor + smooth * inv
        inv = torch.where(
            wavelen > old_len / s.low_freq_factor,
            inv / s.factor,
            torch.where(wavelen < old_len / s.high_freq_factor, inv, smoothed),
        )
    elif s.type == "yarn":
        low, high = _yarn_correction_range(spec)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = 1.0 / (s.factor * pos_freqs) * (1 - extrapolation) + inv * extrapolation
    return inv


def _yarn_correction_range(spec: RopeSpec) -> tuple[float, float]:
    """YaRN's band of dims ramped between interpolation and extrapolation (never zero-width)."""
    s = spec.scaling

    def dim_for(rotations: float) -> float:
        ratio = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return spec.rotary_dim * math.log(ratio) / (2 * math.log(spec.base))

    low, high = dim_for(s.beta_fast), dim_for(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, spec.rotary_dim - 1)
    return low, (high + 0.001 if low == high else high)


def attention_scaling(spec: RopeSpec) -> float:
    """Factor the model multiplies cos/sin by (YaRN's mscale; 1.0 otherwise), so rotated K carries it."""
    s = spec.scaling
    if s.type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)

    def mscale(m: float) -> float:
        return 1.0 if s.factor <= 1 else 0.1 * m * math.log(s.factor) + 1.0

    if s.mscale and s.mscale_all_dim:
        return mscale(s.mscale) / mscale(s.mscale_all_dim)
    return mscale(1.0)


def _angles(spec: RopeSpec, positions: torch.Tensor) -> torch.Tensor:
    """Float64 angles [tokens, rotary_dim // 2]; signed positions give signed angles."""
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D [tokens], got shape {tuple(positions.shape)}")
    freqs = inv_freq(spec).to(device=positions.device, dtype=torch.float64)
    return positions.to(torch.float64)[:, None] * freqs


def cos_sin(
    spec: RopeSpec, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's cos/sin per (token, frequency pair): [tokens, rotary_dim // 2], times ``attention_scaling``."""
    angles, scale = _angles(spec, positions), attention_scaling(spec)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def table_mismatch(spec: RopeSpec, table: torch.Tensor, span: int = 2048, stride: int = 16) -> int | None:
    """The first position (every `stride`-th below `span`) where a model's own cos/sin table
    ([positions, rotary_dim]: cos, then sin, times the attention factor: SGLang's
    `rotary_emb.cos_sin_cache`) differs from ``spec``'s by more than float rounding in its dtype
    (angles in float32 lose about ``position * 6e-8`` radians); None where it matches."""
    if table.dim() != 2 or table.shape[1] != spec.rotary_dim:
        return 0
    positions = torch.arange(0, min(span, table.shape[0]), stride)
    cos, sin = cos_sin(spec, positions)
    gap = (torch.cat([cos, sin], dim=-1) - table[positions].float()).abs().amax(dim=-1)
    wrong = (gap > max(1e-3, 2 * torch.finfo(table.dtype).eps)).nonzero()
    return int(positions[wrong[0, 0]]) if wrong.numel() else None


def _apply(x: torch.Tensor, angles: torch.Tensor, scale: float, spec: RopeSpec) -> torch.Tensor:
    """Rotate ``x[..., :rotary_dim]`` by ``angles`` and multiply it by ``scale``, in float32."""
    if x.dim() < 2 or x.shape[0] != angles.shape[0] or x.shape[-1] != spec.head_dim:
        raise ValueError(
            f"x must be [tokens, ..., head_dim={spec.head_dim}] with {angles.shape[0]} tokens, "
            f"got shape {tuple(x.shape)}"
        )
    view = (angles.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    cos = (angles.cos() * scale).to(torch.float32).view(view)
    sin = (angles.sin() * scale).to(torch.float32).view(view)
    r = spec.rotary_dim
    xf = x.to(torch.float32)
    rot, rest = xf[..., :r], xf[..., r:]
    if spec.layout == "half":
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rot = torch.cat((y1, y2), -1) if spec.layout == "half" else torch.stack((y1, y2), -1).flatten(-2)
    return torch.cat((rot, rest), -1).to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Apply RoPE as the model does: x [tokens, heads, head_dim] at ``positions`` [tokens]."""
    return _apply(x, _angles(spec, positions), attention_scaling(spec), spec)


def unrotate(k: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Exact inverse of ``rotate``: rotates back and divides out the attention factor."""
    return _apply(k, -_angles(spec, positions), 1.0 / attention_scaling(spec), spec)


def rerotate(
    k: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor, spec: RopeSpec
) -> torch.Tensor:
    """Move K rotated at ``from_positions`` to ``to_positions`` with one rotation by the (signed) delta.

    Exact because every supported type's angle is ``position * inv_freq``; the attention factor
    K already carries is left as is.  Dynamic NTK K written under a different ``seq_len`` must
    instead go through ``rotate(unrotate(k, p0, spec_then), p1, spec_now)``.
    """
    if from_positions.shape != to_positions.shape:
        raise ValueError(
            f"from/to positions differ in shape: {tuple(from_positions.shape)} vs {tuple(to_positions.shape)}"
        )
    delta = to_positions.to(torch.int64) - from_positions.to(torch.int64)
    return _apply(k, _angles(spec, delta), 1.0, spec)
