"""Attention over KV read at a shift: RoPE is relative, so a run read away from its frame
costs one rotation of the query, not one of every key.

The pool keeps K as SGLang writes it, rotated at the position of the row that computed it
(the slot's frame, core/slot_frames). A row that reads slot s at its own position n sees that
key at shift d = n - frame[s], and <R_m q, R_(f+d) k> = <R_(m-d) q, R_f k>: the reader may
rotate its query by -d instead of the key by +d. Every key of a Master run read by one row has
the same d, so:

* decode (`decode_tiles`, `tiled_decode_attention`): a row's keys are grouped by shift into
  tiles of one shift each (`tile_size` per batch); a tile's query is rotated once, its partial
  attention and log-sum-exp computed (one flash-attention call for a few rows, their tiles as
  its batch), and the tiles of a row merged by log-sum-exp (split-K decoding). The Triton kernel
  (`tiled_decode_attention_triton`, for CUDA) does the same per tile in one program per
  (row, head), checked against the torch path under TRITON_INTERPRET=1.
* extend (`extend_grids`, `row_attention`): many queries read the same keys, so the gathered
  keys whose shift is not 0 are rotated once (`ShiftedReads.shift_`), then core/attention's
  batched attention runs as for any row.

Rows whose every shift is 0 never come here: they are SGLang's layout, served by SGLang's own
attention (srt/attention.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from sglang_tokendance.core.attention import Grid, attend, plan_grids, sdpa_with_lse
from sglang_tokendance.core.rope import RopeSpec, attention_scaling, cos_sin
from sglang_tokendance.core.slot_frames import SlotFrames

KEYS_PER_CALL = 4096  # keys (tiles x tile) one torch decode call takes: ~3 MB of K (SmolLM2)


class ShiftedReads:
    """Slots' K rotated at their frames; a reader rotates what it reads by the shift.

    Rotation by d is k * C[|d|] + swap(k) * S[|d|] * sign(d) (C: cos on the rotated dims, 1
    elsewhere; S: -sin / +sin on a pair's first / second dim; swap exchanges each pair's dims):
    core/rope's formula as a few full-width ops on cached tables, without the attention factor
    (K carries YaRN's already)."""

    def __init__(self, spec: RopeSpec, frames: SlotFrames):
        self.spec = spec
        self.frames = frames
        half = torch.arange(spec.rotary_dim // 2)
        self._first, self._second = (2 * half, 2 * half + 1) if spec.layout == "interleaved" else \
            (half, half + spec.rotary_dim // 2)
        self._tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def shifts(self, slots: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.frames.shifts(slots, positions)

    def tables(self, largest: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(cos, sin [size, rotary_dim // 2], C, S [size, head_dim]) of shifts 0..size - 1,
        size > largest."""
        tables = self._tables.get(device)
        if tables is None or tables[0].shape[0] <= largest:
            size = max(largest + 1, 256 if tables is None else 2 * tables[0].shape[0])
            cos, sin = cos_sin(self.spec, torch.arange(size, device=device))
            cos, sin = cos / attention_scaling(self.spec), sin / attention_scaling(self.spec)
            c = torch.ones(size, self.spec.head_dim, device=device)
            s = torch.zeros_like(c)
            c[:, self._first], c[:, self._second] = cos, cos
            s[:, self._first], s[:, self._second] = -sin, sin
            tables = self._tables[device] = (cos, sin, c, s)
        return tables

    def shift_(self, k: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """Rotate k [..., heads, d] by `shift` [...] in place where it is not 0 (callers pass
        gathered copies) and return it: K read at frame f becomes K at f + shift."""
        flat, moved = k.view(-1, *k.shape[-2:]), shift.reshape(-1)
        where = moved.nonzero().squeeze(1)
        if where.numel():
            flat[where] = self.turned(flat[where], moved[where])
        return k

    def turned(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """x [n, heads, d] rotated by `shift` [n] (a new tensor, every row, no host sync but
        the table's size)."""
        cos, sin = self.turning(shift)
        return self.turn(x, cos[:, None], sin[:, None])

    def turning(self, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables [n, d] that `turn` rotates by `shift` [n] with."""
        distance = shift.abs()
        _, _, c, s = self.tables(int(distance.max()) if distance.numel() else 0, shift.device)
        return c[distance], s[distance] * torch.where(shift < 0, -1.0, 1.0).to(s.dtype)[:, None]

    def turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x rotated by the tables `turning` gave (broadcast against x)."""
        xf = x.float()
        return (xf * cos).addcmul_(self._swap_pairs(xf), sin).to(x.dtype)

    def _swap_pairs(self, k: torch.Tensor) -> torch.Tensor:
        """k with the two dims of every rotated pair exchanged (slices, not a gather)."""
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
    rows = [slot_table[i, :p + n].to(torch.int64) for i, p, n in zip(row_index.tolist(), prefix_lens, extend_lens)]
    return plan_grids(request, position, rows)


def row_attention(grids: list[Grid], q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  reads: ShiftedReads) -> torch.Tensor:
    """Output [tokens, heads, dv] of the planned queries q [tokens, heads, d] over their rows of
    `keys` (rotated at their slots' frames) and `values` ([slots, kv_heads, d]), causal by
    position, GQA."""
    out = q.new_empty(q.shape[0], q.shape[1], values.shape[2])
    none = keys[:0]  # no overlay: every key comes from the store
    for grid in grids:
        out[grid.tokens] = attend(grid, q, none, none, keys, values, scale, reads=reads)
    return out


TILE_COST = 32  # a tile's fixed work (its query turned, its partial merged) in keys attended: CPU torch


def tile_size(groups: torch.Tensor, largest: int) -> int:
    """Keys per tile for groups of `groups` keys each (one shift of one row): the power of two
    up to `largest` that spends least on padding and on the tiles' fixed work. Short Master runs
    get short tiles (little padding), long ones long tiles (few queries turned and merged)."""
    sizes = [1 << i for i in range(4, largest.bit_length())] if largest >= 16 else [largest]
    cost = [int(((groups + t - 1) // t).sum()) * (t + TILE_COST) for t in sizes]
    return sizes[cost.index(min(cost))]


@dataclass(frozen=True)
class DecodeTiles:
    """A decode batch's keys in tiles of one shift each, sorted by row: tile t holds up to
    `slots.shape[1]` keys of batch row `row[t]`, all read at shift `shift[t]`; `first[b]` is
    row b's first tile (first[B]: the number of tiles); `cos` / `sin` [T, head_dim] turn a
    tile's query by minus its shift (ShiftedReads.turning's tables, gathered once per forward)."""

    row: torch.Tensor  # [T] int64
    shift: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T, tile] int64 (padding: slot 0)
    valid: torch.Tensor  # [T, tile] bool
    first: torch.Tensor  # [B + 1] int64
    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor  # [T, 1, head_dim]
    buffers: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def gather(self, source: torch.Tensor, slots: torch.Tensor, which: int) -> torch.Tensor:
        """source[slots] ([*slots.shape, kv_heads, d]) into buffer `which`, one per forward
        reused by every layer: a fresh tensor of megabytes per layer and call costs its page
        faults each time (glibc maps large blocks anew), more than the gather itself."""
        n = slots.numel()
        buffer = self.buffers.get(which)
        fits = buffer is not None and buffer.shape[0] >= n and buffer.shape[1:] == source.shape[1:]
        if not fits or buffer.dtype != source.dtype:
            largest = max(call.tiles.stop - call.tiles.start for call in self.calls) * self.slots.shape[1]
            buffer = self.buffers[which] = source.new_empty(max(n, largest), *source.shape[1:])
        return torch.index_select(source, 0, slots.reshape(-1), out=buffer[:n]).view(*slots.shape, *source.shape[1:])

    @functools.cached_property
    def padding(self) -> torch.Tensor:
        """[T, tile] additive attention mask of the padding (-inf), built once per forward."""
        return torch.zeros(self.valid.shape, device=self.valid.device).masked_fill_(~self.valid, float("-inf"))

    @functools.cached_property
    def calls(self) -> list[TileCall]:
        """Consecutive rows taken together: up to KEYS_PER_CALL keys, or one longer row alone.
        Read on the host once per forward."""
        first, calls, start = self.first.tolist(), [], 0
        per_call = max(1, KEYS_PER_CALL // self.slots.shape[1])
        for b in range(1, len(first)):
            if b == len(first) - 1 or first[b + 1] - first[start] > per_call:
                calls.append(TileCall.of(slice(start, b), first[start:b + 1], self.row.device))
                start = b
        return calls


@dataclass(frozen=True)
class TileCall:
    """Rows `rows` (their tiles `tiles`) in one attention call; `spread` [R, M] places a row's
    tiles side by side (`hole`: past a row's last tile) so that they merge in a few dense ops."""

    rows: slice
    tiles: slice
    spread: torch.Tensor  # [R, M] int64, into the call's tiles
    hole: torch.Tensor  # [R, M, 1] bool

    @staticmethod
    def of(rows: slice, first: list[int], device: torch.device) -> "TileCall":
        start = torch.tensor(first[:-1], device=device) - first[0]
        count = torch.tensor(first[1:], device=device) - first[0] - start
        at = torch.arange(int(count.max()), device=device)
        hole = at >= count[:, None]
        spread = (start[:, None] + at).masked_fill_(hole, 0)
        return TileCall(rows, slice(first[0], first[-1]), spread, hole[..., None])


def decode_tiles(slot_table: torch.Tensor, row_index: torch.Tensor, lengths: list[int], reads: ShiftedReads,
                 largest_tile: int = 256) -> DecodeTiles:
    """Tiles of a decode batch: request b reads the first lengths[b] slots of row
    slot_table[row_index[b]], key j at position j; its keys are grouped by shift (each group
    in row order) and each group cut into tiles (`tile_size`, at most `largest_tile`). One
    pass over the whole batch."""
    device = slot_table.device
    longest = max(lengths)
    rows = slot_table[row_index.to(device), :longest].to(torch.int64)
    inside = torch.arange(longest, device=device) < torch.tensor(lengths, device=device)[:, None]
    request = torch.arange(len(lengths), device=device)[:, None].expand_as(rows)[inside]
    shift, slot = reads.shifts(rows)[inside], rows[inside]
    low = shift.min() if shift.numel() else 0
    key = request * (int(shift.max() - low) + 1 if shift.numel() else 1) + (shift - low)  # (request, shift)
    key, order = torch.sort(key, stable=True)  # row order kept within a group
    _, counts = torch.unique_consecutive(key, return_counts=True)
    tile = tile_size(counts, largest_tile)
    per_group = (counts + tile - 1) // tile
    tiles = int(per_group.sum())
    group_start = torch.cumsum(counts, 0) - counts
    padded_start = (torch.cumsum(per_group, 0) - per_group) * tile
    rank = torch.arange(key.numel(), device=device) - torch.repeat_interleave(group_start, counts)
    place = torch.repeat_interleave(padded_start, counts) + rank
    slots = torch.zeros(tiles * tile, dtype=torch.int64, device=device)
    valid = torch.zeros(tiles * tile, dtype=torch.bool, device=device)
    slots[place], valid[place] = slot[order], True
    row = torch.repeat_interleave(request[order][group_start], per_group)
    first = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=device)
    first[1:] = torch.cumsum(torch.bincount(row, minlength=len(lengths)), 0)
    tile_shift = torch.repeat_interleave(shift[order][group_start], per_group)
    cos, sin = reads.turning(-tile_shift)
    return DecodeTiles(row, tile_shift, slots.view(tiles, tile), valid.view(tiles, tile), first, cos[:, None],
                       sin[:, None])


def tiled_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tiles: DecodeTiles,
                           scale: float, reads: ShiftedReads) -> torch.Tensor:
    """One decode step, torch: q [B, heads, d] over the tiles' keys (rotated at their frames)
    and values, GQA; out [B, heads, dv]. A few rows at a time (`DecodeTiles.calls`: the
    gathered KV stays small, as in SGLang's row-by-row torch decode): one attention call over
    their tiles as a batch, each tile's query rotated by minus its shift, then each row's tiles
    merged by their log-sum-exp."""
    tq = reads.turn(q[tiles.row], tiles.cos, tiles.sin)[:, :, None]  # [T, heads, 1, d]
    padding = tiles.padding.to(q.dtype)
    out = q.new_empty(q.shape[0], q.shape[1], values.shape[2])
    for call in tiles.calls:
        slots = tiles.slots[call.tiles]
        part, lse = sdpa_with_lse(tq[call.tiles], tiles.gather(keys, slots, 0).transpose(1, 2).to(q.dtype),
                                  tiles.gather(values, slots, 1).transpose(1, 2).to(q.dtype),
                                  padding[call.tiles, None, None], scale)
        weight = torch.softmax(lse[:, :, 0][call.spread].masked_fill_(call.hole, float("-inf")), 1)  # [R, M, heads]
        out[call.rows] = torch.einsum("rmh,rmhd->rhd", weight, part[:, :, 0].float()[call.spread]).to(q.dtype)
    return out


def tiled_decode_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tiles: DecodeTiles,
                                  scale: float, reads: ShiftedReads) -> torch.Tensor:
    """`tiled_decode_attention` in one Triton kernel: program (b, h) walks row b's tiles, rotates
    its query by minus each tile's shift once and folds the tile into an online softmax."""
    batch, heads, head_dim = q.shape
    kv_heads, dv = keys.shape[1], values.shape[2]
    spec = reads.spec
    half = spec.rotary_dim // 2
    out = q.new_empty(batch, heads, dv)
    if batch == 0:
        return out
    cos, sin, _, _ = reads.tables(int(tiles.shift.abs().max()) if tiles.shift.numel() else 0, q.device)
    slots = tiles.slots.contiguous()
    valid = tiles.valid.to(torch.int8).contiguous()
    _tiled_decode_kernel[(batch, heads)](
        q, keys, values, slots, valid, tiles.shift, tiles.first, cos, sin, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        slots.stride(0), out.stride(0), out.stride(1), cos.stride(0), scale,
        GROUP=heads // kv_heads, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), ROTARY=spec.rotary_dim,
        REST=head_dim - spec.rotary_dim, BLOCK_REST=triton.next_power_of_2(max(head_dim - spec.rotary_dim, 1)),
        DV=dv, BLOCK_DV=triton.next_power_of_2(dv), INTERLEAVED=spec.layout == "interleaved",
        TILE=slots.shape[1],
    )
    return out


@triton.jit
def _tiled_decode_kernel(Q, K, V, Slots, Valid, Shift, First, Cos, Sin, Out,
                         stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_tile,
                         stride_ob, stride_oh, stride_cos, scale,
                         GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, ROTARY: tl.constexpr,
                         REST: tl.constexpr, BLOCK_REST: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                         INTERLEAVED: tl.constexpr, TILE: tl.constexpr):
    """Program (b, h): query head h of request b over its tiles; keys are read as stored."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
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
    n = tl.arange(0, TILE)
    best = -float("inf")
    total = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for t in range(tl.load(First + b), tl.load(First + b + 1)):
        shift = tl.load(Shift + t)
        distance = tl.abs(shift)
        cos = tl.load(Cos + distance * stride_cos + pair, mask=in_pair, other=1.0)
        sin = tl.load(Sin + distance * stride_cos + pair, mask=in_pair, other=0.0)
        sin = tl.where(shift > 0, -sin, sin)  # the query turns by minus the shift
        r1 = q1 * cos - q2 * sin
        r2 = q2 * cos + q1 * sin
        valid = tl.load(Valid + t * stride_tile + n) != 0
        slot = tl.load(Slots + t * stride_tile + n).to(tl.int64)
        k_base = K + slot[:, None] * stride_kn + kv_head * stride_kh
        pair_mask = valid[:, None] & in_pair[None, :]
        k1 = tl.load(k_base + first[None, :], mask=pair_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_base + second[None, :], mask=pair_mask, other=0.0).to(tl.float32)
        score = tl.sum(k1 * r1[None, :], 1) + tl.sum(k2 * r2[None, :], 1)
        if REST > 0:
            k_rest = tl.load(k_base + ROTARY + rest[None, :], mask=valid[:, None] & in_rest[None, :], other=0.0)
            score += tl.sum(k_rest.to(tl.float32) * q_rest[None, :], 1)
        score = tl.where(valid, score * scale, -float("inf"))
        new_best = tl.maximum(best, tl.max(score, 0))
        alpha = tl.exp(best - new_best)
        p = tl.exp(score - new_best)
        v = tl.load(V + slot[:, None] * stride_vn + kv_head * stride_vh + dv[None, :],
                    mask=valid[:, None] & in_dv[None, :], other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        best = new_best
    tl.store(Out + b * stride_ob + h * stride_oh + dv, (acc / total).to(Out.dtype.element_ty), mask=in_dv)
