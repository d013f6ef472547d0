"""HF transformers' Llama / Qwen2 / Qwen3 / Mistral models as a core.blend LayerwiseModel.

The quality harness and the fast tests run the blended prefill in-process on these, with a
dense KV store (one row per request), instead of through a server: the probe layers can be
shared across settings and full-vocabulary logits come for free. The layer math is HF's own
modules, so a full prefill here equals HF's forward.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sglang_tokendance.core.blend import blended_prefill
from sglang_tokendance.core.blend_types import BlendOptions, RequestRow
from sglang_tokendance.core.dense_kv import DenseKV

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class HFLayerwise:
    """Layer-at-a-time access to an HF causal LM (`model.model` is its decoder)."""

    def __init__(self, causal_lm):
        model_type = causal_lm.config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
        self.lm = causal_lm
        self.decoder = causal_lm.model
        self.num_layers = len(self.decoder.layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(ids)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's cos/sin at `positions` ([1, n, d])."""
        return self.decoder.rotary_emb(self.decoder.embed_tokens.weight, positions.unsqueeze(0))

    def qkv(self, layer: int, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        attn = self.decoder.layers[layer].self_attn
        x = self.decoder.layers[layer].input_layernorm(hidden)
        d = attn.head_dim
        q = attn.q_proj(x).view(x.shape[0], -1, d)
        k = attn.k_proj(x).view(x.shape[0], -1, d)
        v = attn.v_proj(x).view(x.shape[0], -1, d)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rotary
        q, k = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v

    def attention_scale(self, layer: int) -> float:
        return self.decoder.layers[layer].self_attn.scaling

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        block = self.decoder.layers[layer]
        hidden = hidden + block.self_attn.o_proj(attn)
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.norm(hidden)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(normed)

    def kv_shape(self) -> tuple[int, int]:
        attn = self.decoder.layers[0].self_attn
        return self.lm.config.num_key_value_heads, attn.head_dim


def full_prefill(model: HFLayerwise, ids: torch.Tensor) -> tuple[torch.Tensor, DenseKV]:
    """One request's plain prefill: final normed hidden states and its KV (slot = position)."""
    kv = DenseKV(model.num_layers, ids.numel(), *model.kv_shape())
    row = RequestRow(prefix_len=0, num_tokens=ids.numel(), slots=torch.arange(ids.numel()))
    hidden, _ = blended_prefill(model, kv, ids, torch.arange(ids.numel()), [row], BlendOptions(), None)
    return hidden, kv
