"""core/attention: scattered queries attend causally by absolute position."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_tokendance.core.attention import position_masked_attention


def full_causal(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=scale)
    return out.transpose(0, 1)


def test_scattered_queries_equal_rows_of_the_full_causal_attention():
    torch.manual_seed(0)
    n, heads, kv_heads, d = 12, 6, 2, 8
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    positions = torch.arange(n)
    full = full_causal(q, k, v, d ** -0.5)
    rows = torch.tensor([0, 3, 4, 11])
    part = position_masked_attention(q[rows], k, v, positions[rows], positions, d ** -0.5)
    assert torch.allclose(part, full[rows], atol=1e-6)
    assert torch.allclose(position_masked_attention(q, k, v, positions, positions, d ** -0.5), full, atol=1e-6)


def test_keys_after_the_query_position_are_ignored():
    q = torch.randn(1, 2, 4)
    k, v = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    out = position_masked_attention(q, k, v, torch.tensor([0]), torch.tensor([0, 1, 2]), 0.5)
    assert torch.allclose(out, v[0].expand(2, 4).unsqueeze(0), atol=1e-6)  # only key 0 is visible


def test_heads_must_group_evenly():
    with pytest.raises(ValueError, match="multiple"):
        position_masked_attention(torch.randn(1, 3, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4),
                                  torch.tensor([1]), torch.tensor([0, 1]), 1.0)
