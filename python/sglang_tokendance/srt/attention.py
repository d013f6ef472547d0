"""Attention backend "tokendance": K stored un-rotated in the KV pool, RoPE applied on read.

Selected by `--tokendance-storage mirror` (our launcher and Engine pass `--attention-backend
tokendance`). The model hands the backend K already rotated at each token's position
(forward_batch.positions); the backend un-rotates it as it writes the pool, and rotates every
key it reads by the key's position in the reading request's row (its index in req_to_token).
For a key read at the position it was written at, this is SGLang's attention within float
rounding; a slot read by several rows at different positions (zero-copy reuse of a Master's
slots) is rotated for each reader.

It subclasses SGLang's TorchNativeAttnBackend for its pools and batch bookkeeping, and owns
the KV write and the attention: extend and decode queries are planned once per forward
(core/rope_attention grids) and each layer runs one batched attention per grid; on CUDA a
decode step runs the fused Triton kernel instead. Sliding-window, cross- and encoder-only
attention are not served (the supported families have none).
"""

from __future__ import annotations

from typing import Callable

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_tokendance.core.attention import Grid
from sglang_tokendance.core.rope import RopeSpec
from sglang_tokendance.core.rope_attention import (
    RopeOnRead,
    decode_attention_triton,
    decode_grids,
    extend_grids,
    row_attention,
)


class TokenDanceAttnBackend(TorchNativeAttnBackend):
    """SGLang attention over a KV pool whose K is un-rotated."""

    def __init__(self, model_runner):
        super().__init__(model_runner)
        try:
            self.rope = RopeOnRead(RopeSpec.from_hf_config(model_runner.model_config.hf_config))
        except ValueError as e:
            raise ValueError(f"--tokendance-storage mirror cannot serve this model's RoPE: {e}") from None
        self.plan: Callable[[], list[Grid]] | None = None  # this forward's query layout, planned on first use
        self.grids: list[Grid] | None = None  # the planned layout; None: the fused decode kernel
        self.longest = 0  # the longest row this forward (RoPE tables, the fused decode kernel)

    def init_forward_metadata(self, forward_batch) -> None:
        """Lays out this forward's queries lazily: an extend batch the blended prefill serves
        (srt/forward_hook) never calls the backend, so it never pays for the grids."""
        super().init_forward_metadata(forward_batch)
        mode, table = forward_batch.forward_mode, self.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices_cpu  # a host copy (absent in SGLang's warm-up batches)
        rows = forward_batch.req_pool_indices if rows is None else rows
        self.grids = None
        if mode.is_decode():
            lengths = forward_batch.seq_lens_cpu.tolist()
            self.longest = max(lengths)
            on_cuda = torch.device(self.device).type == "cuda"
            self.plan = None if on_cuda else lambda: decode_grids(table, rows, lengths)
        elif mode.is_extend():
            prefix, extend = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
            self.longest = max(p + n for p, n in zip(prefix, extend))
            self.plan = lambda: extend_grids(table, rows, prefix, extend)
        else:  # a forward without attention (idle)
            self.plan, self.longest = list, 0

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool) -> torch.Tensor:
        """Write K un-rotated (at the new tokens' positions) and V, then attend with RoPE on read."""
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY or (
                layer.sliding_window_size is not None and layer.sliding_window_size > -1):
            raise NotImplementedError("the tokendance attention backend serves causal full attention only")
        if save_kv_cache and k is not None and v is not None:
            k = self.rope.unrotate(k.view(-1, layer.tp_k_head_num, layer.qk_head_dim), forward_batch.positions,
                                   self.longest)
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                                k, v)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        values = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if self.grids is None and self.plan is not None:
            self.grids = self.plan()
        if self.grids is None:
            out = decode_attention_triton(q, keys, values, self.req_to_token_pool.req_to_token,
                                          forward_batch.req_pool_indices, forward_batch.seq_lens, self.longest,
                                          layer.scaling, self.rope)
        else:
            out = row_attention(self.grids, q, keys, values, layer.scaling, self.rope)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)


def create_backend(model_runner) -> TokenDanceAttnBackend:
    """The `register_attention_backend` factory."""
    return TokenDanceAttnBackend(model_runner)
