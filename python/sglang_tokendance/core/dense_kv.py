"""KV buffers indexed by position, one row, outside SGLang's pool.

The in-process quality harness and the fast tests keep a request's KV here (slot = position),
and the server's planned selection (srt/prompt_selection.py) probes a chunked prompt's later
chunks over one, holding only the probe layers: their KV has no pool slots yet.
"""

from __future__ import annotations

import torch


class DenseKV:
    """KV buffers [slots, kv_heads, d] per layer (a core/blend KVStore)."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.k = torch.zeros(num_layers, slots, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def keys(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def values(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k
        self.v[layer, slots] = v

    def clone(self) -> "DenseKV":
        copy = DenseKV.__new__(DenseKV)
        copy.k, copy.v = self.k.clone(), self.v.clone()
        return copy
