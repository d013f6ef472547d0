"""Torch stand-in for the few `sgl_kernel` ops SGLang imports on the CPU engine path.

SGLang 0.5.23 with SGLANG_USE_CPU_ENGINE=1 does `from sgl_kernel import ...` at import time,
and no CPU build of sgl-kernel exists on the package index. Our launcher puts the folder
holding this module on PYTHONPATH only when the real sgl_kernel cannot be loaded, so it never
shadows a working one. The three ops a cache backend can reach are real implementations
(tested against plain-loop references); the speculative-decoding ones raise.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+sglang_tokendance.fallback"
IS_TOKENDANCE_FALLBACK = True


def _segment_offsets(start_offset: torch.Tensor, end_offset: torch.Tensor) -> list[int]:
    """Where each request's run starts in the packed out_cache_loc (exclusive cumsum)."""
    lengths = (end_offset - start_offset).tolist()
    offsets, total = [], 0
    for length in lengths:
        offsets.append(total)
        total += length
    return offsets


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = packed run i of out_cache_loc."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offsets = _segment_offsets(start_offset, end_offset)
    for row, start, end, offset in zip(req_pool_indices.tolist(), starts, ends, offsets):
        if end > pool_len:
            raise IndexError(f"assign_req_to_token_pool_cpu: end {end} > pool_len {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[offset : offset + end - start].to(
            req_to_token.dtype
        )


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Packed run i of out_cache_loc = req_to_token[req_pool_indices[i], start[i]:end[i]]."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offsets = _segment_offsets(start_offset, end_offset)
    for row, start, end, offset in zip(req_pool_indices.tolist(), starts, ends, offsets):
        if end > pool_len:
            raise IndexError(f"assign_extend_cache_locs_cpu: end {end} > pool_len {pool_len}")
        out_cache_loc[offset : offset + end - start] = req_to_token[row, start:end].to(
            out_cache_loc.dtype
        )


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer b (a raw pointer with a row stride in bytes): row tgt[j] = row src[j].

    SGLang hands over raw data pointers of its per-layer K/V buffers, so each buffer is viewed
    as bytes up to the highest row touched. Sources are gathered before any write, which
    makes overlapping source and target sets safe, as in the triton kernel.
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError("copy_all_layer_kv_cache_cpu: tgt_loc and src_loc differ in length")
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.long)
    src = src_loc.to(torch.long)
    rows = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(int(ptr))
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        view[tgt] = view[src]


def _speculative_only(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is sglang-tokendance's CPU fallback for "
            "sgl_kernel, which implements no speculative-decoding ops. Run speculative "
            "decoding with a real sgl_kernel build."
        )

    op.__name__ = name
    return op


_SPECULATIVE_OPS = (
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
    "rotate_input_ids_cpu",
)
for _name in _SPECULATIVE_OPS:
    globals()[_name] = _speculative_only(_name)
del _name


def __getattr__(name: str):
    # AttributeError, not ImportError, so hasattr() probes keep working.
    raise AttributeError(
        f"sgl_kernel.{name} is not available: sglang-tokendance's CPU fallback for sgl_kernel "
        "provides only the ops SGLang's CPU text-generation path imports. Install a real "
        "sgl_kernel build for this feature."
    )
