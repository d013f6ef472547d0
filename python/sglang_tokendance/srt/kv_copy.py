"""Copying KV between slots of SGLang's KV pool, every layer at once per call.

Segments are stored with K un-rotated (one canonical form per content hash, whatever
offset the first copy came from): caching a segment copies request slots -> segment slots
through `unrotate`, restoring one copies segment slots -> request slots through `rotate` at
the reading request's positions. Callers gather every run of a batch into one call, and the
K of all layers is transformed in one rotation (one cos/sin table for the call), so a copy
costs one gather/scatter per layer and one rotation however many spans and layers it moves.
"""

from __future__ import annotations

from typing import Callable

import torch

from sglang_tokendance.core.rope import RopeSpec

KTransform = Callable[[torch.Tensor, torch.Tensor, RopeSpec], torch.Tensor]


def copy_kv(pool, src: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor, k_transform: KTransform,
            rope: RopeSpec) -> None:
    """Copy every layer's K and V from slots `src` to slots `dst` (int64, same length); K
    passes through `k_transform(k, positions, rope)` (rotate or unrotate at `positions`)."""
    if src.numel() == 0:
        return
    layers = range(pool.start_layer, pool.start_layer + pool.layer_num)
    keys = k_transform(torch.stack([pool.get_key_buffer(layer)[src] for layer in layers], dim=1), positions, rope)
    for i, layer in enumerate(layers):  # keys: [tokens, layers, kv_heads, head_dim]
        k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        k[dst] = keys[:, i].to(k.dtype)
        v[dst] = v[src]


def bytes_per_token(pool) -> int:
    """KV bytes of one token over every layer, K and V."""
    k = pool.get_key_buffer(pool.start_layer)
    return 2 * pool.layer_num * k[0].numel() * k.element_size()
