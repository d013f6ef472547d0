"""core/rope_attention: attention over un-rotated K, rotated by the reader's positions as it
reads, equals plain attention over K stored rotated; the Triton decode kernel equals the torch
reference (run under TRITON_INTERPRET=1 on the CPU, in a child process: Triton decides at
import whether its kernels are interpreted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sglang_tokendance.core.attention import plan_grids
from sglang_tokendance.core.rope import RopeScaling, RopeSpec, rotate, unrotate
from sglang_tokendance.core.rope_attention import (
    RopeOnRead,
    decode_attention_triton,
    decode_grids,
    extend_grids,
    row_attention,
)

HEADS, KV_HEADS, D = 6, 2, 16
SCALE = D ** -0.5
SPECS = {
    "default": RopeSpec(D, D, 10000.0),
    "llama3": RopeSpec(D, D, 500000.0, scaling=RopeScaling("llama3", 8.0, original_max_position_embeddings=16)),
    "yarn": RopeSpec(D, D, 10000.0, scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=16)),
    "partial-interleaved": RopeSpec(D, 8, 10000.0, layout="interleaved"),
}


class Pool:
    """Rows of given lengths scattered over one slot table; `rotated` holds K as SGLang stores
    it (rotated at each key's position in its row), `unrotated` as mirror storage does."""

    def __init__(self, lengths: list[int], spec: RopeSpec, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        slots = sum(lengths) + 3
        self.lengths = lengths
        self.rotated = torch.randn(slots, KV_HEADS, D, generator=gen)
        self.values = torch.randn(slots, KV_HEADS, D, generator=gen)
        order = torch.randperm(slots - 1, generator=gen) + 1
        self.table = torch.zeros(len(lengths) + 2, max(lengths) + 4, dtype=torch.int32)
        self.row_index = torch.arange(len(lengths)) + 1  # table rows 1.., as SGLang hands them out
        self.unrotated = self.rotated.clone()
        used = 0
        for i, n in zip(self.row_index.tolist(), lengths):
            row = order[used:used + n]
            self.table[i, :n] = row
            self.unrotated[row] = unrotate(self.rotated[row], torch.arange(n), spec)
            used += n

    def row(self, b: int) -> torch.Tensor:
        return self.table[self.row_index[b], :self.lengths[b]].to(torch.int64)

    def reference(self, q: torch.Tensor, b: int, positions: torch.Tensor) -> torch.Tensor:
        """Plain causal attention of queries q [n, heads, d] at `positions` over rotated K."""
        row = self.row(b)
        group = HEADS // KV_HEADS
        k = self.rotated[row].repeat_interleave(group, 1).transpose(0, 1)
        v = self.values[row].repeat_interleave(group, 1).transpose(0, 1)
        visible = torch.arange(row.numel()) <= positions[:, None]
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=SCALE).transpose(0, 1)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_extend_over_unrotated_keys_equals_attention_over_rotated_keys(name):
    """A plain prefill, a chunk after a long prefix (packed under a position mask) and a
    one-token chunk, in one batch."""
    spec = SPECS[name]
    pool = Pool([12, 30, 7], spec)
    prefix, extend = [0, 26, 6], [12, 4, 1]
    q = torch.randn(sum(extend), HEADS, D, generator=torch.Generator().manual_seed(1))
    grids = extend_grids(pool.table, pool.row_index, prefix, extend)
    assert sorted(g.mask is None for g in grids) == [False, True]  # both grid kinds are exercised
    got = row_attention(grids, q, pool.unrotated, pool.values, SCALE, RopeOnRead(spec))
    want = torch.cat([pool.reference(qb, b, torch.arange(p, p + n))
                      for b, (qb, p, n) in enumerate(zip(q.split(extend), prefix, extend))])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_scattered_queries_read_rotated_keys_by_position():
    """The blended prefill's layout: any subset of positions of each row."""
    spec = SPECS["default"]
    pool = Pool([20, 9], spec, seed=2)
    picks = [torch.tensor([0, 4, 5, 11, 19]), torch.tensor([8])]
    request = torch.cat([torch.full((p.numel(),), b) for b, p in enumerate(picks)])
    grids = plan_grids(request, torch.cat(picks), [pool.row(0), pool.row(1)])
    q = torch.randn(request.numel(), HEADS, D, generator=torch.Generator().manual_seed(3))
    got = row_attention(grids, q, pool.unrotated, pool.values, SCALE, RopeOnRead(spec))
    want = torch.cat([pool.reference(qb, b, p) for b, (qb, p) in enumerate(zip(q.split([5, 1]), picks))])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_decode_over_unrotated_keys_equals_attention_over_rotated_keys(name):
    spec = SPECS[name]
    pool = Pool([1, 33, 8], spec, seed=4)
    q = torch.randn(3, HEADS, D, generator=torch.Generator().manual_seed(5))
    got = row_attention(decode_grids(pool.table, pool.row_index, pool.lengths), q, pool.unrotated, pool.values,
                        SCALE, RopeOnRead(spec))
    want = torch.cat([pool.reference(q[b:b + 1], b, torch.tensor([n - 1])) for b, n in enumerate(pool.lengths)])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_a_slot_read_at_another_position_is_rotated_there():
    """The point of storing K un-rotated: one slot serves readers at different positions."""
    spec = SPECS["default"]
    rope = RopeOnRead(spec)
    k = torch.randn(1, KV_HEADS, D)
    stored = rope.unrotate(rotate(k, torch.tensor([3]), spec), torch.tensor([3]), 4)[0]  # written at position 3
    rows = torch.zeros(2, 9, KV_HEADS, D)
    rows[0, 7], rows[1, 2] = stored, stored  # read by two rows, at positions 7 and 2
    read = rope(rows)
    torch.testing.assert_close(read[0, 7], rotate(k, torch.tensor([7]), spec)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(read[1, 2], rotate(k, torch.tensor([2]), spec)[0], atol=1e-5, rtol=1e-5)


def test_unrotate_then_read_is_the_identity_at_the_writers_position():
    spec = SPECS["yarn"]
    rope = RopeOnRead(spec)
    k = torch.randn(5, KV_HEADS, D)
    positions = torch.arange(5)
    torch.testing.assert_close(rope(rope.unrotate(k, positions, 5)[None])[0], k, atol=1e-5, rtol=1e-5)


def test_the_cos_sin_table_grows_with_the_rows():
    spec = SPECS["llama3"]
    rope = RopeOnRead(spec)
    for length in (10, 300, 1000):  # within the first table, then past it twice
        k = torch.randn(2, length, KV_HEADS, D)
        positions = torch.arange(length)
        want = rotate(k.transpose(0, 1), positions, spec).transpose(0, 1)
        torch.testing.assert_close(rope(k), want, atol=1e-5, rtol=1e-5)
    assert rope.table(1, torch.device("cpu"))[0].shape[0] >= 1000


def triton_cases() -> list[tuple[str, list[int]]]:
    return [(name, lengths) for name in sorted(SPECS) for lengths in ([1, 33, 8], [70], [40, 50])]


def share_slots(pool: Pool) -> None:
    """Rows 0 and 1 read the same 20 slots (a Master) at different positions: row 1's positions
    [25, 45) point at row 0's slots [5, 25), as mirror storage's zero copy does."""
    first, second = pool.row_index[:2].tolist()
    pool.table[second, 25:45] = pool.table[first, 5:25]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="run by test_triton_kernel_on_the_cpu")
@pytest.mark.parametrize("name,lengths", triton_cases())
def test_triton_decode_equals_the_torch_reference(name, lengths):
    spec = SPECS[name]
    pool = Pool(lengths, spec, seed=6)
    if len(lengths) == 2:
        share_slots(pool)
    q = torch.randn(len(lengths), HEADS, D, generator=torch.Generator().manual_seed(7))
    rope = RopeOnRead(spec)
    want = row_attention(decode_grids(pool.table, pool.row_index, lengths), q, pool.unrotated, pool.values,
                         SCALE, rope)
    got = decode_attention_triton(q, pool.unrotated, pool.values, pool.table, pool.row_index,
                                  torch.tensor(lengths, dtype=torch.int32), max(lengths), SCALE, rope)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for b, n in enumerate(lengths):  # and both equal attention over K rotated at each reader's positions
        row = pool.row(b)
        k = rotate(pool.unrotated[row], torch.arange(n), spec)
        group = HEADS // KV_HEADS
        plain = F.scaled_dot_product_attention(q[b, :, None], k.repeat_interleave(group, 1).transpose(0, 1),
                                               pool.values[row].repeat_interleave(group, 1).transpose(0, 1),
                                               scale=SCALE)[:, 0]
        torch.testing.assert_close(got[b], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this is the child's parent")
def test_triton_kernel_on_the_cpu():
    """The Triton kernel's tests, in a child process with TRITON_INTERPRET=1."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                             "-k", "test_triton_decode_equals_the_torch_reference"],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                            timeout=600, cwd=os.path.dirname(__file__))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"{len(triton_cases())} passed" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_unrotate_from_the_cached_tables_equals_core_rope(name):
    """What the pool keeps of K (the backend and the blended prefill un-rotate every K they
    write) comes from RopeOnRead's cached tables, grown past their first size, and is the exact
    inverse of the model's rotation, YaRN's attention factor divided out."""
    spec = SPECS[name]
    rope = RopeOnRead(spec)
    k, positions = torch.randn(40, KV_HEADS, D), torch.randint(0, 700, (40,))
    rotated = rotate(k, positions, spec)
    torch.testing.assert_close(rope.unrotate(rotated, positions, 700), unrotate(rotated, positions, spec),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope.unrotate(rotated, positions, 700), k, atol=1e-4, rtol=1e-4)
