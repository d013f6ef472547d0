"""Attention over K stored un-rotated: RoPE is applied by the reader's positions as keys are read.

SGLang's pool keeps K rotated at the position of the request that wrote it, so a slot can only
be read at that position. Kept un-rotated (position-agnostic), one slot can serve every request
that reads it, each at its own offset: a reader rotates each key by that key's position in its
own row (its index in req_to_token), which is the position the key has in the reader's prompt.
Rotation happens after the gather, before the dot products; for a key written and read at the
same position this equals attention over rotated K within float rounding.

* `RopeOnRead`: the un-rotate on write and the rotate on read, as core/attention's
  `key_transform` seam takes it (the batched attention there is the torch reference).
* `extend_grids` / `decode_grids`: an SGLang extend or decode batch's queries planned once per
  forward (core/attention.plan_grids), then `row_attention` per layer.
* `decode_attention_triton`: the decode step fused in one Triton kernel (gather the row's slots,
  rotate each key by its index in the row, online softmax), for CUDA; checked against
  `row_attention` under TRITON_INTERPRET=1 on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_tokendance.core.attention import Grid, attend, plan_grids
from sglang_tokendance.core.rope import RopeSpec, attention_scaling, cos_sin


class RopeOnRead:
    """K kept un-rotated in the KV store; each reader rotates a key by its position in its row.

    The cos/sin of row positions 0.. are computed once per device (grown as rows grow), so a
    forward's layers do not recompute them. The torch path rotates a whole gathered row in
    a few full-width ops, k * C + swap(k) * S (C: cos on rotated dims, 1 elsewhere; S: -sin /
    +sin on a pair's first / second dim, 0 elsewhere; swap exchanges each pair's dims) --
    core/rope's formula, without splitting or transposing the rows."""

    def __init__(self, spec: RopeSpec):
        self.spec = spec
        half = torch.arange(spec.rotary_dim // 2)
        self._first, self._second = (2 * half, 2 * half + 1) if spec.layout == "interleaved" else \
            (half, half + spec.rotary_dim // 2)
        self._tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _tables_for(self, length: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(cos, sin [size, rotary_dim // 2], C, S, and the inverse's C, S [size, head_dim]),
        size >= length. The inverse divides out the attention factor (YaRN) on the rotated dims."""
        tables = self._tables.get(device)
        if tables is None or tables[0].shape[0] < length:
            size = max(length, 256 if tables is None else 2 * tables[0].shape[0])
            cos, sin = cos_sin(self.spec, torch.arange(size, device=device))
            c = torch.ones(size, self.spec.head_dim, device=device)
            s = torch.zeros_like(c)
            c[:, self._first], c[:, self._second] = cos, cos
            s[:, self._first], s[:, self._second] = -sin, sin
            inverse = 1.0 / attention_scaling(self.spec) ** 2
            c_inv, s_inv = c.clone(), -s * inverse
            rotated = torch.cat((self._first, self._second))
            c_inv[:, rotated] *= inverse
            tables = self._tables[device] = (cos, sin, c, s, c_inv, s_inv)
        return tables

    def table(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos/sin [>= length, rotary_dim // 2] of positions 0.. (core/rope.cos_sin)."""
        return self._tables_for(length, device)[:2]

    def unrotate(self, k: torch.Tensor, positions: torch.Tensor, longest: int) -> torch.Tensor:
        """What the store keeps of K the model rotated at `positions` ([tokens, kv_heads, d]),
        every position below `longest` (core/rope.unrotate, from the cached tables)."""
        _, _, _, _, c, s = self._tables_for(longest, k.device)
        return self._turn(k, c[positions, None], s[positions, None])

    def __call__(self, k: torch.Tensor) -> torch.Tensor:
        """core/attention's KeyTransform: gathered rows k [..., Lk, kv_heads, d], key j read at
        row position j."""
        length = k.shape[-3]
        _, _, c, s, _, _ = self._tables_for(length, k.device)
        return self._turn(k, c[:length, None], s[:length, None])

    def _turn(self, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        kf = k.float()  # in place on the product: out-of-place addcmul broadcasts far slower on the CPU
        return (kf * c).addcmul_(self._swap_pairs(kf), s).to(k.dtype)

    def _swap_pairs(self, k: torch.Tensor) -> torch.Tensor:
        """k with the two dims of every rotated pair exchanged (slices, not a gather: far faster on the CPU)."""
        r, half = self.spec.rotary_dim, self.spec.rotary_dim // 2
        if self.spec.layout == "half":
            pairs = (k[..., half:r], k[..., :half])
        else:
            pairs = (k[..., :r].unflatten(-1, (half, 2)).flip(-1).flatten(-2),)
        return torch.cat((*pairs, k[..., r:]), -1)


def extend_grids(slot_table: torch.Tensor, row_index: torch.Tensor, prefix_lens: list[int],
                 extend_lens: list[int]) -> list[Grid]:
    """Grids of an extend batch: request b's queries are positions [prefix_lens[b], + extend_lens[b])
    of row slot_table[row_index[b]] (SGLang: req_to_token, req_pool_indices)."""
    device = slot_table.device
    counts = torch.tensor(extend_lens, device=device)
    request = torch.repeat_interleave(torch.arange(len(extend_lens), device=device), counts)
    position = torch.cat([torch.arange(p, p + n, device=device) for p, n in zip(prefix_lens, extend_lens)])
    lengths = [p + n for p, n in zip(prefix_lens, extend_lens)]
    return plan_grids(request, position, _rows(slot_table, row_index, lengths))


def decode_grids(slot_table: torch.Tensor, row_index: torch.Tensor, lengths: list[int]) -> list[Grid]:
    """Grids of a decode batch: one query per request, at the last of its `lengths[b]` positions."""
    device = slot_table.device
    position = torch.tensor(lengths, device=device) - 1
    return plan_grids(torch.arange(len(lengths), device=device), position, _rows(slot_table, row_index, lengths))


def _rows(slot_table: torch.Tensor, row_index: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return [slot_table[i, :n].to(torch.int64) for i, n in zip(row_index.tolist(), lengths)]


def row_attention(grids: list[Grid], q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  rope: RopeOnRead) -> torch.Tensor:
    """Output [tokens, heads, dv] of the planned queries q [tokens, heads, d] over their rows of
    `keys` (un-rotated) and `values` ([slots, kv_heads, d]), causal by position, GQA."""
    out = q.new_empty(q.shape[0], q.shape[1], values.shape[2])
    none = keys[:0]  # no overlay: every key comes from the store
    for grid in grids:
        out[grid.tokens] = attend(grid, q, none, none, keys, values, scale, key_transform=rope)
    return out


def decode_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_table: torch.Tensor,
                            row_index: torch.Tensor, lengths: torch.Tensor, longest: int, scale: float,
                            rope: RopeOnRead) -> torch.Tensor:
    """One decode step: q [B, heads, d] (request b at position lengths[b] - 1) over the first
    lengths[b] (at most `longest`, known on the host) slots of row slot_table[row_index[b]],
    keys un-rotated; out [B, heads, dv]."""
    batch, heads, head_dim = q.shape
    kv_heads, dv = keys.shape[1], values.shape[2]
    spec = rope.spec
    half = spec.rotary_dim // 2
    cos, sin = rope.table(longest, q.device)
    out = q.new_empty(batch, heads, dv)
    if batch == 0:
        return out
    _decode_kernel[(batch, heads)](
        q, keys, values, slot_table, row_index, lengths, cos, sin, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        slot_table.stride(0), out.stride(0), out.stride(1), cos.stride(0), scale,
        GROUP=heads // kv_heads, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), ROTARY=spec.rotary_dim,
        REST=head_dim - spec.rotary_dim, BLOCK_REST=triton.next_power_of_2(max(head_dim - spec.rotary_dim, 1)),
        DV=dv, BLOCK_DV=triton.next_power_of_2(dv), INTERLEAVED=spec.layout == "interleaved", BLOCK_N=32,
    )
    return out


@triton.jit
def _decode_kernel(Q, K, V, Table, RowIndex, Lengths, Cos, Sin, Out,
                   stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_table,
                   stride_ob, stride_oh, stride_cos, scale,
                   GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, ROTARY: tl.constexpr,
                   REST: tl.constexpr, BLOCK_REST: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                   INTERLEAVED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (b, h): query head h of request b, keys rotated pair by pair as they are loaded."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    length = tl.load(Lengths + b)
    row = tl.load(RowIndex + b).to(tl.int64)
    pair = tl.arange(0, BLOCK_HALF)
    in_pair = pair < HALF
    if INTERLEAVED:
        first, second = 2 * pair, 2 * pair + 1
    else:
        first, second = pair, pair + HALF
    q_base = Q + b * stride_qb + h * stride_qh
    q1 = tl.load(q_base + first, mask=in_pair, other=0.0).to(tl.float32)
    q2 = tl.load(q_base + second, mask=in_pair, other=0.0).to(tl.float32)
    rest = tl.arange(0, BLOCK_REST)
    in_rest = rest < REST
    q_rest = tl.load(q_base + ROTARY + rest, mask=in_rest, other=0.0).to(tl.float32)
    dv = tl.arange(0, BLOCK_DV)
    in_dv = dv < DV
    best = -float("inf")
    total = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_row = n < length
        slot = tl.load(Table + row * stride_table + n, mask=in_row, other=0).to(tl.int64)
        k_base = K + slot[:, None] * stride_kn + kv_head * stride_kh
        pair_mask = in_row[:, None] & in_pair[None, :]
        k1 = tl.load(k_base + first[None, :], mask=pair_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_base + second[None, :], mask=pair_mask, other=0.0).to(tl.float32)
        cos = tl.load(Cos + n[:, None] * stride_cos + pair[None, :], mask=pair_mask, other=0.0)
        sin = tl.load(Sin + n[:, None] * stride_cos + pair[None, :], mask=pair_mask, other=0.0)
        score = tl.sum((k1 * cos - k2 * sin) * q1[None, :], 1) + tl.sum((k2 * cos + k1 * sin) * q2[None, :], 1)
        if REST > 0:
            k_rest = tl.load(k_base + ROTARY + rest[None, :], mask=in_row[:, None] & in_rest[None, :], other=0.0)
            score += tl.sum(k_rest.to(tl.float32) * q_rest[None, :], 1)
        score = tl.where(in_row, score * scale, -float("inf"))
        new_best = tl.maximum(best, tl.max(score, 0))
        alpha = tl.exp(best - new_best)
        p = tl.exp(score - new_best)
        v = tl.load(V + slot[:, None] * stride_vn + kv_head * stride_vh + dv[None, :],
                    mask=in_row[:, None] & in_dv[None, :], other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        best = new_best
    tl.store(Out + b * stride_ob + h * stride_oh + dv, (acc / total).to(Out.dtype.element_ty), mask=in_dv)
