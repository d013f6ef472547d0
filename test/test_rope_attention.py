"""core/rope_attention: attention over K kept rotated at each slot's frame, read by rows at
other positions (a Master's slots, read in place), equals plain attention over K rotated at the
reader's positions; the Triton decode kernel equals the torch reference (run under
TRITON_INTERPRET=1 on the CPU, in a child process: Triton decides at import whether its
kernels are interpreted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sglang_tokendance.core.attention import attend, plan_grids
from sglang_tokendance.core import rope_attention
from sglang_tokendance.core.rope import RopeScaling, RopeSpec, rerotate, rotate
from sglang_tokendance.core.rope_attention import (
    ShiftedReads,
    decode_tiles,
    extend_grids,
    row_attention,
    tile_size,
    tiled_decode_attention,
    tiled_decode_attention_triton,
)
from sglang_tokendance.core.slot_frames import SlotFrames

HEADS, KV_HEADS, D = 6, 2, 16
SCALE = D ** -0.5
SPECS = {
    "default": RopeSpec(D, D, 10000.0),
    "llama3": RopeSpec(D, D, 500000.0, scaling=RopeScaling("llama3", 8.0, original_max_position_embeddings=16)),
    "yarn": RopeSpec(D, D, 10000.0, scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=16)),
    "partial-interleaved": RopeSpec(D, 8, 10000.0, layout="interleaved"),
}


class Pool:
    """Rows of given lengths over one slot table, K as SGLang writes it (rotated at each slot's
    frame, recorded in `frames`). Row 0 is the author; with `share`, each later row's positions
    [at, at + run) read the author's slots [start, start + run) in place, so that run is read at
    shift at - start (negative where it sits earlier than the author had it)."""

    def __init__(self, lengths: list[int], spec: RopeSpec, seed: int = 0,
                 share: list[tuple[int, int, int]] | None = None):
        gen = torch.Generator().manual_seed(seed)
        slots = sum(lengths) + 3
        self.spec, self.lengths = spec, lengths
        self.plain_k = torch.randn(slots, KV_HEADS, D, generator=gen)  # before RoPE
        self.values = torch.randn(slots, KV_HEADS, D, generator=gen)
        order = torch.randperm(slots - 1, generator=gen) + 1
        self.table = torch.zeros(len(lengths) + 2, max(lengths) + 4, dtype=torch.int32)
        self.row_index = torch.arange(len(lengths)) + 1  # table rows 1.., as SGLang hands them out
        self.frames = SlotFrames(slots)
        self.keys = self.plain_k.clone()
        used = 0
        for i, n in zip(self.row_index.tolist(), lengths):
            row = order[used:used + n]
            self.table[i, :n] = row
            self.keys[row] = rotate(self.plain_k[row], torch.arange(n), spec)
            self.frames.record(row, torch.arange(n))
            used += n
        for b, (at, start, run) in enumerate(share or [], start=1):
            self.table[self.row_index[b], at:at + run] = self.table[self.row_index[0], start:start + run]

    def row(self, b: int) -> torch.Tensor:
        return self.table[self.row_index[b], :self.lengths[b]].to(torch.int64)

    def reference(self, q: torch.Tensor, b: int, positions: torch.Tensor) -> torch.Tensor:
        """Plain causal attention of queries q [n, heads, d] at `positions` over row b's keys
        rotated afresh at the row's own positions."""
        row = self.row(b)
        group = HEADS // KV_HEADS
        k = rotate(self.plain_k[row], torch.arange(row.numel()), self.spec)
        k = k.repeat_interleave(group, 1).transpose(0, 1)
        v = self.values[row].repeat_interleave(group, 1).transpose(0, 1)
        visible = torch.arange(row.numel()) <= positions[:, None]
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=SCALE).transpose(0, 1)

    def reads(self) -> ShiftedReads:
        return ShiftedReads(self.spec, self.frames)


# Row 1 reads the author's [5, 25) at [25, 45) (shift +20); row 2 reads [30, 40) at [2, 12) (-28).
SHARED = dict(lengths=[48, 50, 20], share=[(25, 5, 20), (2, 30, 10)])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_shift_moves_keys_as_core_rope_rerotates_them(name):
    """Shifts up, down, 0 and past the first table (it grows), in place where not 0."""
    spec = SPECS[name]
    reads = ShiftedReads(spec, SlotFrames(4))
    k = torch.randn(6, KV_HEADS, D)
    frames = torch.tensor([3, 40, 7, 900, 0, 12])
    shift = torch.tensor([5, -33, 0, 700, 1, -12])
    want = rerotate(rotate(k, frames, spec), frames, frames + shift, spec)
    got = reads.shift_(rotate(k, frames, spec), shift)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, rotate(k, frames + shift, spec), atol=1e-4, rtol=1e-4)
    assert reads.tables(0, torch.device("cpu"))[0].shape[0] > 700


def test_frames_give_each_reader_its_shift():
    frames = SlotFrames(10)
    frames.record(torch.tensor([3, 4, 5]), torch.tensor([7, 8, 9]))
    assert frames.shifts(torch.tensor([3, 4, 5]), torch.tensor([7, 8, 9])).tolist() == [0, 0, 0]
    assert frames.shifts(torch.tensor([[3, 4, 5]])).tolist() == [[-7, -7, -7]]  # read at 0, 1, 2
    assert frames.shifts(torch.tensor([5]), torch.tensor([20])).dtype == torch.int64


@pytest.mark.parametrize("name", sorted(SPECS))
def test_extend_over_shifted_rows_equals_attention_at_the_readers_positions(name):
    """A plain prefill, a chunk after a long prefix that holds a shifted run (packed under a
    position mask) and a one-token chunk after a run read at a negative shift, in one batch."""
    spec = SPECS[name]
    pool = Pool(spec=spec, seed=1, **SHARED)
    prefix, extend = [0, 46, 19], [48, 4, 1]
    q = torch.randn(sum(extend), HEADS, D, generator=torch.Generator().manual_seed(1))
    grids = extend_grids(pool.table, pool.row_index, prefix, extend)
    assert sorted(g.mask is None for g in grids) == [False, True]  # both grid kinds are exercised
    got = row_attention(grids, q, pool.keys, pool.values, SCALE, pool.reads())
    want = torch.cat([pool.reference(qb, b, torch.arange(p, p + n))
                      for b, (qb, p, n) in enumerate(zip(q.split(extend), prefix, extend))])
    torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)


def test_scattered_queries_read_shifted_keys_by_position():
    """The blended prefill's layout: any subset of positions of each row."""
    pool = Pool(spec=SPECS["default"], seed=2, **SHARED)
    picks = [torch.tensor([0, 4, 5, 11, 47]), torch.tensor([30, 49]), torch.tensor([3])]
    request = torch.cat([torch.full((p.numel(),), b) for b, p in enumerate(picks)])
    grids = plan_grids(request, torch.cat(picks), [pool.row(b) for b in range(3)])
    q = torch.randn(request.numel(), HEADS, D, generator=torch.Generator().manual_seed(3))
    got = row_attention(grids, q, pool.keys, pool.values, SCALE, pool.reads())
    want = torch.cat([pool.reference(qb, b, p) for b, (qb, p) in enumerate(zip(q.split([5, 2, 1]), picks))])
    torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)


def test_overlaid_keys_are_not_shifted():
    """Keys `attend` overlays (computed at the reader's positions already) are used as given,
    even where the slot under them belongs to a run read at a shift."""
    spec = SPECS["default"]
    pool = Pool(spec=spec, seed=8, **SHARED)
    row, at = pool.row(1), 30  # inside row 1's run read at +20
    positions = torch.tensor([at, 49])
    grids = plan_grids(torch.tensor([0, 0]), positions, [row], overlay=torch.tensor([True, False]))
    assert len(grids) == 1 and grids[0].overlay_tokens.tolist() == [0]
    q, k, v = torch.randn(2, HEADS, D), torch.randn(2, KV_HEADS, D), torch.randn(2, KV_HEADS, D)
    got = attend(grids[0], q, k, v, pool.keys, pool.values, SCALE, reads=pool.reads())
    group = HEADS // KV_HEADS
    keys, values = rotate(pool.plain_k[row], torch.arange(50), spec), pool.values[row].clone()
    keys[at], values[at] = k[0], v[0]
    visible = torch.arange(50) <= positions[:, None]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    want = F.scaled_dot_product_attention(q.transpose(0, 1), keys.repeat_interleave(group, 1).transpose(0, 1),
                                          values.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask,
                                          scale=SCALE).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)


def test_decode_tiles_group_each_row_by_shift():
    pool = Pool(spec=SPECS["default"], seed=4, **SHARED)
    tiles = decode_tiles(pool.table, pool.row_index, pool.lengths, pool.reads(), largest_tile=8)
    assert tiles.first.tolist()[0] == 0 and tiles.first.tolist()[-1] == tiles.row.numel()
    for b, n in enumerate(pool.lengths):
        mine = slice(int(tiles.first[b]), int(tiles.first[b + 1]))
        assert (tiles.row[mine] == b).all()
        held = tiles.slots[mine][tiles.valid[mine]]
        assert sorted(held.tolist()) == sorted(pool.row(b).tolist())  # every key once, no other
        row_shift = pool.frames.shifts(pool.row(b))
        for t in range(mine.start, mine.stop):
            slots = tiles.slots[t][tiles.valid[t]]
            positions = torch.nonzero(pool.row(b)[:, None] == slots[None, :])[:, 0]
            assert (row_shift[positions] == tiles.shift[t]).all()  # one shift per tile
    assert sorted(set(tiles.shift.tolist())) == [-28, 0, 20]


def test_tile_size_follows_the_groups_lengths():
    """Padding against the tiles' fixed work (32 keys each): two groups of 10 keys take tiles of
    16 (2 x 48 < 2 x 64), two of 100 tiles of 128 (2 x 160 < 4 x 96), never above the largest."""
    assert tile_size(torch.tensor([10, 12]), 256) == 16
    assert tile_size(torch.tensor([100, 100]), 256) == 128
    assert tile_size(torch.tensor([1000]), 256) == 256
    assert tile_size(torch.tensor([1000]), 64) == 64
    assert tile_size(torch.tensor([5, 9]), 4) == 4


@pytest.mark.parametrize("tile,per_call", [(4, 256), (4, 20), (64, 4096)])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_tiled_decode_equals_attention_at_the_readers_positions(name, tile, per_call, monkeypatch):
    """Tiles of 4 and up to 64 keys; rows taken together or (20 keys a call) one by one."""
    monkeypatch.setattr(rope_attention, "KEYS_PER_CALL", per_call)
    spec = SPECS[name]
    pool = Pool(spec=spec, seed=4, **SHARED)
    q = torch.randn(3, HEADS, D, generator=torch.Generator().manual_seed(5))
    tiles = decode_tiles(pool.table, pool.row_index, pool.lengths, pool.reads(), largest_tile=tile)
    assert len(tiles.calls) == (3 if per_call == 20 else 1)
    tiled_decode_attention(q, torch.randn_like(pool.keys), torch.randn_like(pool.values), tiles, SCALE,
                           pool.reads())  # a layer before: its gathered KV must not linger in the tiles' buffers
    got = tiled_decode_attention(q, pool.keys, pool.values, tiles, SCALE, pool.reads())
    want = torch.cat([pool.reference(q[b:b + 1], b, torch.tensor([n - 1])) for b, n in enumerate(pool.lengths)])
    torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)


def triton_cases() -> list[tuple[str, int]]:
    return [(name, tile) for name in sorted(SPECS) for tile in (4, 16)]


def triton_decode_against_torch(name: str, tile: int, device: str) -> None:
    """The Triton decode on `device` equals the torch reference on the CPU."""
    spec = SPECS[name]
    pool = Pool(spec=spec, seed=6, lengths=[48, 50, 20, 1], share=[(25, 5, 20), (2, 30, 10)])
    q = torch.randn(4, HEADS, D, generator=torch.Generator().manual_seed(7))
    tiles = decode_tiles(pool.table, pool.row_index, pool.lengths, pool.reads(), largest_tile=tile)
    want = tiled_decode_attention(q, pool.keys, pool.values, tiles, SCALE, pool.reads())
    pool.frames.frame = pool.frames.frame.to(device)
    reads = pool.reads()
    tiles = decode_tiles(pool.table.to(device), pool.row_index.to(device), pool.lengths, reads, largest_tile=tile)
    got = tiled_decode_attention_triton(q.to(device), pool.keys.to(device), pool.values.to(device), tiles, SCALE,
                                        reads)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_triton_kernel_on_the_cpu")
@pytest.mark.parametrize("name,tile", triton_cases())
def test_triton_decode_equals_the_torch_reference(name, tile):
    triton_decode_against_torch(name, tile, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh runs it)")
@pytest.mark.parametrize("name,tile", triton_cases())
def test_triton_decode_on_cuda_equals_the_torch_reference(name, tile):
    triton_decode_against_torch(name, tile, "cuda")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this is the child's parent")
def test_triton_kernel_on_the_cpu():
    """The Triton kernel's tests, in a child process with TRITON_INTERPRET=1."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                             "-k", "test_triton_decode_equals_the_torch_reference"],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                            timeout=600, cwd=os.path.dirname(__file__))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"{len(triton_cases())} passed" in result.stdout, result.stdout[-2000:]
