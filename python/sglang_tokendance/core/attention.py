"""Attention for scattered queries, causal by absolute position.

When only some tokens of a prompt are computed (the rest reuse cached KV), the queries are
no longer the contiguous suffix SGLang's extend kernels assume. Each query attends to every
key whose position is not after its own, over the request's full KV row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              q_positions: torch.Tensor, k_positions: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """q [nq, heads, d], k/v [nk, kv_heads, d] (GQA: heads a multiple of kv_heads);
    returns [nq, heads, d]. Query i sees key j iff k_positions[j] <= q_positions[i]."""
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=_causal_mask(q_positions, k_positions), scale=scale,
    )
    return out.transpose(0, 1)


def attention_received(q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor,
                       k_positions: torch.Tensor, scale: float, chunk: int = 256) -> torch.Tensor:
    """[nk] attention mass the queries pay each key (softmax weights summed over queries and
    heads, same causal rule as position_masked_attention): how much a key's error can reach
    the tokens that read it. Queries go `chunk` at a time to bound the weights' memory."""
    k = _expand_kv(k, q.shape[1]).float()
    mass = torch.zeros(k.shape[0], dtype=torch.float32, device=k.device)
    for start in range(0, q.shape[0], chunk):
        logits = torch.einsum("qhd,khd->hqk", q[start:start + chunk].float(), k) * scale
        mask = _causal_mask(q_positions[start:start + chunk], k_positions)
        mass += logits.masked_fill(~mask, float("-inf")).softmax(-1).sum((0, 1))
    return mass


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: repeat each KV head for the query heads that share it."""
    kv_heads = x.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    return x.repeat_interleave(heads // kv_heads, dim=1)


def _causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """[nq, nk]: query i sees key j iff k_positions[j] <= q_positions[i]."""
    return k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)
