"""Copying KV between slots of SGLang's KV pool, every layer at once per call, in the pool's K form.

Under dense storage segments are copied with K un-rotated (one canonical form per content
hash, whatever offset the first copy came from), while the pool holds K rotated at each token's
own position, as SGLang writes it (`PoolKeys`). Caching a segment copies request slots ->
segment slots through `PoolKeys.unrotated`, restoring one copies segment slots -> request slots
through `PoolKeys.pooled` at the reading request's positions: one rotation each way. (Mirror
storage copies nothing: rows read Masters in place, srt/storage.py.)
Callers gather every run of a batch into one call, and the K of all layers is transformed at
once, so a copy costs one gather/scatter per layer and at most one rotation however many spans
and layers it moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sglang_tokendance.core.rope import RopeSpec, rotate, table_mismatch, unrotate
from sglang_tokendance.srt.model import rotary_table

KTransform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (k [tokens, ..., d], positions [tokens])


@dataclass(frozen=True)
class PoolKeys:
    """K in the KV pool, rotated at each token's position by the model's RoPE."""

    rope: RopeSpec

    @property
    def unrotated(self) -> KTransform:
        """K read from the pool at some positions, un-rotated (a copied segment's form)."""
        return lambda k, positions: unrotate(k, positions, self.rope)

    @property
    def pooled(self) -> KTransform:
        """Un-rotated K as the pool holds it at some positions."""
        return lambda k, positions: rotate(k, positions, self.rope)


def serving_rope_spec(hf_config, model=None) -> RopeSpec:
    """The RoPE SGLang's `rotary_emb` applies for this config, as core/rope specifies it:
    dynamic NTK at SGLang's fixed stretch (its cos/sin table is built once for
    max_position_embeddings * factor positions, unlike HF's per-forward length). Raises
    ValueError for a RoPE core/rope cannot reproduce (longrope, mrope, ...), and, given the
    served `model`, where its own `rotary_emb` table differs from the spec's: cached K would be
    moved with another rotation than the one the model wrote it with."""
    spec = RopeSpec.from_hf_config(hf_config)
    scaling = spec.scaling
    if scaling.type == "dynamic":
        spec = RopeSpec.from_hf_config(hf_config, seq_len=scaling.max_position_embeddings * scaling.factor)
    table = None if model is None else rotary_table(model)
    position = None if table is None else table_mismatch(spec, table)
    if position is not None:
        raise ValueError(f"the model's own rotary_emb differs from the RoPE its config gives ({spec}) at position "
                         f"{position}: cached K cannot be moved between positions")
    return spec


def copy_kv(pool, src: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor,
            k_transform: KTransform | None) -> None:
    """Copy every layer's K and V from slots `src` to slots `dst` (int64, same length); K
    passes through `k_transform(k, positions)` (a `PoolKeys` direction; None: K as it is)."""
    if src.numel() == 0:
        return
    layers = range(pool.start_layer, pool.start_layer + pool.layer_num)
    keys = None if k_transform is None else \
        k_transform(torch.stack([pool.get_key_buffer(layer)[src] for layer in layers], dim=1), positions)
    for i, layer in enumerate(layers):  # keys: [tokens, layers, kv_heads, head_dim]
        k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        k[dst] = k[src] if keys is None else keys[:, i].to(k.dtype)
        v[dst] = v[src]


def bytes_per_token(pool) -> int:
    """KV bytes of one token over every layer, K and V."""
    k = pool.get_key_buffer(pool.start_layer)
    return 2 * pool.layer_num * k[0].numel() * k.element_size()
