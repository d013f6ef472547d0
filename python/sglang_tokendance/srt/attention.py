"""Attention backend "tokendance": SGLang's own attention for every row that reads its KV where
it was written, the shifted path only for rows that read Masters in place.

Selected by `--tokendance-storage mirror` (our launcher and Engine pass `--attention-backend
tokendance`). The pool keeps K as SGLang writes it, rotated at each token's position; every
forward records its new slots' frames (core/slot_frames, in the allocator,
srt/pool.RefCountedAllocator). A row that reads a slot at another position than its frame (a
Master's slots, read in place by zero-copy reuse) has a shift there; a row with none is SGLang's
layout. Per forward, the rows are split once:

* rows without a shift run TorchNativeAttnBackend -- SGLang's own attention here -- untouched
  (a batch without any shifted row is SGLang's forward as it is);
* the others run core/rope_attention: decode as tiles of one shift each, the query rotated
  once per tile and the tiles merged by log-sum-exp (the Triton kernel on CUDA); extend over
  the rows' gathered keys with the shifted ones rotated.

Sliding-window, cross- and encoder-only attention are not served (the supported families have
none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_tokendance.core.attention import Grid
from sglang_tokendance.core.rope_attention import (
    DecodeTiles,
    ShiftedReads,
    decode_tiles,
    extend_grids,
    row_attention,
    tiled_decode_attention,
    tiled_decode_attention_triton,
)
from sglang_tokendance.srt.kv_copy import serving_rope_spec


@dataclass(frozen=True)
class ShiftedRows:
    """This forward's rows that read some slot at a shift (batch indices, their tokens in the
    flat q) and their attention layout; the other rows run SGLang's backend."""

    rows: torch.Tensor
    plain: torch.Tensor
    tokens: torch.Tensor
    plain_tokens: torch.Tensor
    layout: DecodeTiles | list[Grid]


class TokenDanceAttnBackend(TorchNativeAttnBackend):
    """SGLang's torch-native attention, with the rows that read at a shift split off."""

    def __init__(self, model_runner):
        super().__init__(model_runner)
        try:
            spec = serving_rope_spec(model_runner.model_config.hf_config, getattr(model_runner, "model", None))
        except ValueError as e:
            raise ValueError(f"--tokendance-storage mirror cannot serve this model's RoPE: {e}") from None
        self.reads = ShiftedReads(spec, model_runner.token_to_kv_pool_allocator.frames)
        self.on_cuda = torch.device(self.device).type == "cuda"
        self.shifted: ShiftedRows | None = None  # None: no row of this forward reads at a shift

    def init_forward_metadata(self, forward_batch) -> None:
        """Records the new slots' frames, then finds the rows that read at a shift."""
        super().init_forward_metadata(forward_batch)
        mode = forward_batch.forward_mode
        self.shifted = None
        if not (mode.is_decode() or mode.is_extend()) or forward_batch.out_cache_loc is None:
            return
        self.reads.frames.record(forward_batch.out_cache_loc, forward_batch.positions)
        table = self.req_to_token_pool.req_to_token
        index = forward_batch.req_pool_indices_cpu  # a host copy (absent in SGLang's warm-up batches)
        index = forward_batch.req_pool_indices if index is None else index
        lengths = forward_batch.seq_lens_cpu.tolist()
        held = table[index.to(table.device), :max(lengths)].to(torch.int64)
        inside = torch.arange(held.shape[1], device=held.device) < forward_batch.seq_lens_cpu.to(held.device)[:, None]
        shifted = ((self.reads.shifts(held) != 0) & inside).any(1).nonzero().squeeze(1).tolist()
        if not shifted:
            return
        counts = [1] * len(lengths) if mode.is_decode() else list(forward_batch.extend_seq_lens_cpu)
        rows = torch.tensor(shifted)
        plain = torch.tensor(sorted(set(range(len(lengths))) - set(shifted)), dtype=torch.int64)
        tokens, plain_tokens = _tokens_of(counts, rows), _tokens_of(counts, plain)
        if mode.is_decode():
            layout = decode_tiles(table, index[rows], [lengths[b] for b in shifted], self.reads)
        else:
            prefix = forward_batch.extend_prefix_lens_cpu
            layout = extend_grids(table, index[rows], [prefix[b] for b in shifted], [counts[b] for b in shifted])
        self.shifted = ShiftedRows(rows, plain, tokens, plain_tokens, layout)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if self.shifted is None:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self._split(q, k, v, layer, forward_batch, save_kv_cache, self._plain_extend)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if self.shifted is None:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self._split(q, k, v, layer, forward_batch, save_kv_cache, self._plain_decode)

    def _split(self, q, k, v, layer, forward_batch, save_kv_cache: bool, plain) -> torch.Tensor:
        """KV written as SGLang writes it; the plain rows through SGLang's attention, the
        shifted rows through core/rope_attention."""
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY or (
                layer.sliding_window_size is not None and layer.sliding_window_size > -1):
            raise NotImplementedError("the tokendance attention backend serves causal full attention only")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                                k, v)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        values = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        shifted = self.shifted
        if shifted.plain.numel():
            out[shifted.plain_tokens] = plain(q[shifted.plain_tokens], layer, forward_batch, keys, values)
        if isinstance(shifted.layout, DecodeTiles):
            attend = tiled_decode_attention_triton if self.on_cuda else tiled_decode_attention
            out[shifted.tokens] = attend(q[shifted.tokens], keys, values, shifted.layout, layer.scaling, self.reads)
        else:
            out[shifted.tokens] = row_attention(shifted.layout, q[shifted.tokens], keys, values, layer.scaling,
                                                self.reads)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _plain_decode(self, q, layer, forward_batch, keys, values) -> torch.Tensor:
        rows = self.shifted.plain
        out = q.new_empty(q.shape[0], q.shape[1], layer.v_head_dim)
        return self._run_sdpa_forward_decode(q, out, keys, values, self.req_to_token_pool.req_to_token,
                                             forward_batch.req_pool_indices[rows], forward_batch.seq_lens[rows],
                                             scaling=layer.scaling,
                                             enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num)

    def _plain_extend(self, q, layer, forward_batch, keys, values) -> torch.Tensor:
        rows = self.shifted.plain
        out = q.new_empty(q.shape[0], q.shape[1], layer.v_head_dim)
        return self._run_sdpa_forward_extend(q, out, keys, values, self.req_to_token_pool.req_to_token,
                                             forward_batch.req_pool_indices[rows], forward_batch.seq_lens[rows],
                                             forward_batch.extend_prefix_lens[rows],
                                             forward_batch.extend_seq_lens[rows], scaling=layer.scaling,
                                             enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num, causal=True)


def _tokens_of(counts: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Flat token indices of batch rows `rows`, each row `counts[b]` tokens, in batch order."""
    starts = torch.tensor([0] + counts).cumsum(0)
    if rows.numel() == 0:
        return rows
    return torch.cat([torch.arange(int(starts[b]), int(starts[b + 1])) for b in rows.tolist()])


def create_backend(model_runner) -> TokenDanceAttnBackend:
    """The `register_attention_backend` factory."""
    return TokenDanceAttnBackend(model_runner)
