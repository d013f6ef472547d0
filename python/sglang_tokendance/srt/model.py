"""A layer-wise forward that computes only the fresh tokens of an extend batch.

Tokens whose KV was restored from cached segments keep it at every layer (recompute ratio 0);
every other token — private text, missed segments, the last prompt token — runs through all
layers and attends, by absolute position, over its request's whole KV row. The layout stays
SGLang's: every token after the radix prefix is an extend token with its own slot, and the
hidden states come back shaped [extend tokens, hidden] (zeros at reused rows; the logits
processor reads each request's last token, which is always fresh).

Supported: SGLang's LlamaModel (Llama, SmolLM2). Torch attention on the CPU; a GPU attention
path plugs in at `position_masked_attention`.
"""

from __future__ import annotations

import torch

from sglang_tokendance.core.attention import position_masked_attention

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def forward_fresh_tokens(model, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                         fresh: torch.Tensor) -> torch.Tensor:
    """`model` is an SGLang LlamaModel; `fresh` marks the extend tokens to compute."""
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

    pool = get_token_to_kv_pool()
    idx = fresh.nonzero().squeeze(1)
    pos = positions[idx]
    locs = forward_batch.out_cache_loc[idx]
    requests = _request_views(forward_batch, idx, get_req_to_token_pool().req_to_token)
    hidden = model.embed_tokens(input_ids[idx])
    for layer in model.layers[model.start_layer:model.end_layer]:
        attn = layer.self_attn
        radix = attn.attn
        qkv, _ = attn.qkv_proj(layer.input_layernorm(hidden))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(pos, q, k)
        pool.set_kv_buffer(radix, locs, k.view(-1, radix.tp_k_head_num, radix.qk_head_dim),
                           v.view(-1, radix.tp_v_head_num, radix.v_head_dim))
        q = q.view(-1, radix.tp_q_head_num, radix.qk_head_dim)
        keys, values = pool.get_key_buffer(radix.layer_id), pool.get_value_buffer(radix.layer_id)
        out = torch.empty(q.shape[0], radix.tp_q_head_num, radix.v_head_dim, dtype=q.dtype, device=q.device)
        for rows, kv_row, kv_positions in requests:
            out[rows] = position_masked_attention(q[rows], keys[kv_row], values[kv_row], pos[rows],
                                                  kv_positions, radix.scaling)
        attn_out, _ = attn.o_proj(out.reshape(q.shape[0], -1))
        hidden = hidden + attn_out
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden), forward_batch=forward_batch)
    normed = model.norm(hidden)
    full = normed.new_zeros(input_ids.shape[0], normed.shape[1])
    full[idx] = normed
    return full


def _request_views(forward_batch, idx: torch.Tensor, req_to_token: torch.Tensor):
    """Per request: its rows among the fresh tokens, its KV slot row, and the row's positions."""
    views, start = [], 0
    for i, (prefix, extend) in enumerate(zip(forward_batch.extend_prefix_lens_cpu,
                                             forward_batch.extend_seq_lens_cpu)):
        rows = ((idx >= start) & (idx < start + extend)).nonzero().squeeze(1)
        start += extend
        if rows.numel():
            seq_len = prefix + extend
            kv_row = req_to_token[forward_batch.req_pool_indices[i], :seq_len].to(torch.int64)
            views.append((rows, kv_row, torch.arange(seq_len, device=idx.device)))
    return views
