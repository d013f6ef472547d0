"""The torch fallback for sgl_kernel's CPU ops, against plain-loop references."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sglang_tokendance.cpu import FALLBACK_ROOT


@pytest.fixture(scope="module")
def fallback():
    path = FALLBACK_ROOT / "sgl_kernel" / "__init__.py"
    spec = importlib.util.spec_from_file_location("tokendance_sgl_kernel_fallback", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _random_runs(gen: torch.Generator, bs: int, pool_len: int):
    rows = torch.randperm(bs * 3, generator=gen)[:bs]
    starts = torch.randint(0, pool_len // 2, (bs,), generator=gen)
    lens = torch.randint(0, pool_len // 2, (bs,), generator=gen)
    return rows, starts, starts + lens


@pytest.mark.parametrize("bs", [1, 3, 8])
def test_assign_req_to_token_pool_matches_reference(fallback, bs):
    gen = torch.Generator().manual_seed(bs)
    pool_len = 64
    rows, starts, ends = _random_runs(gen, bs, pool_len)
    total = int((ends - starts).sum())
    out_cache_loc = torch.randint(1, 10_000, (total,), generator=gen, dtype=torch.int64)
    table = torch.randint(0, 5, (bs * 3, pool_len), generator=gen, dtype=torch.int32)
    expected = table.clone()
    offset = 0
    for i in range(bs):
        for j in range(int(starts[i]), int(ends[i])):
            expected[rows[i], j] = int(out_cache_loc[offset])
            offset += 1
    fallback.assign_req_to_token_pool_cpu(rows, table, starts, ends, out_cache_loc, pool_len)
    assert torch.equal(table, expected)


@pytest.mark.parametrize("bs", [1, 4, 9])
def test_assign_extend_cache_locs_matches_reference(fallback, bs):
    gen = torch.Generator().manual_seed(100 + bs)
    pool_len = 48
    rows, starts, ends = _random_runs(gen, bs, pool_len)
    table = torch.randint(0, 10_000, (bs * 3, pool_len), generator=gen, dtype=torch.int32)
    total = int((ends - starts).sum())
    out = torch.full((total + 5,), -1, dtype=torch.int64)  # trailing slack stays untouched
    expected = out.clone()
    offset = 0
    for i in range(bs):
        for j in range(int(starts[i]), int(ends[i])):
            expected[offset] = int(table[rows[i], j])
            offset += 1
    fallback.assign_extend_cache_locs_cpu(rows, table, starts, ends, out, pool_len)
    assert torch.equal(out, expected)


def test_assign_rejects_run_past_pool_len(fallback):
    table = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(IndexError, match="pool_len"):
        fallback.assign_req_to_token_pool_cpu(
            torch.tensor([0]), table, torch.tensor([4]), torch.tensor([12]),
            torch.arange(8), 8,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_all_layer_kv_cache_matches_reference(fallback, dtype):
    gen = torch.Generator().manual_seed(7)
    rows, heads, dim, layers = 40, 3, 8, 4
    # Shaped like MHATokenToKVPool: per-layer K then V buffers [rows, heads, dim].
    buffers = [torch.randn(rows, heads, dim, generator=gen).to(dtype) for _ in range(2 * layers)]
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in buffers])
    # Overlapping sets: some targets are also sources, which must be read before any write.
    src = torch.tensor([1, 2, 3, 10, 11, 39], dtype=torch.int64)
    tgt = torch.tensor([2, 3, 4, 20, 10, 0], dtype=torch.int64)
    expected = []
    for b in buffers:
        e = b.clone()
        e[tgt] = b[src].clone()
        expected.append(e)
    fallback.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for b, e in zip(buffers, expected):
        assert torch.equal(b, e)


def test_copy_all_layer_kv_cache_empty_is_noop(fallback):
    buf = torch.randn(4, 2, 2)
    before = buf.clone()
    ptrs = torch.tensor([buf.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([buf.stride(0) * 4])
    empty = torch.empty(0, dtype=torch.int64)
    fallback.copy_all_layer_kv_cache_cpu(ptrs, strides, empty, empty)
    assert torch.equal(buf, before)


@pytest.mark.parametrize("name", [
    "assign_draft_cache_locs_contiguous_cpu", "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "verify_tree_greedy_cpu",
])
def test_speculative_ops_raise_naming_the_op(fallback, name):
    with pytest.raises(NotImplementedError, match=name):
        getattr(fallback, name)(torch.zeros(1))


def test_unknown_op_is_a_clear_attribute_error(fallback):
    assert not hasattr(fallback, "silu_and_mul")
    with pytest.raises(AttributeError, match="fallback"):
        fallback.silu_and_mul
