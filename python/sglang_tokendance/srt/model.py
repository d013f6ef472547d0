"""SGLang's decoder models as core/blend's LayerwiseModel, and its KV pool as a KVStore.

An extend batch in which some request reuses cached segments runs core/blend's blended
prefill instead of the model's own forward (an AROUND hook on the model's forward): the
layout stays SGLang's (every token after the radix prefix is an extend token with its own
slot), and the hidden states come back shaped [extend tokens, hidden] (zeros at the rows of
reused tokens not recomputed; the logits processor reads each request's last token, which is
always computed).

Supported: SGLang's LlamaModel (Llama, SmolLM2, Mistral), Qwen2Model and Qwen3Model, whose
layers share one shape: input_layernorm, self_attn (qkv_proj, rotary_emb, optional per-head
q/k norm, o_proj, RadixAttention), post_attention_layernorm, mlp. Torch attention on the
CPU (core/attention.py); a GPU attention path plugs in at core/attention.attend.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
FORWARD_HOOK_TARGETS = (  # the decoder forwards the AROUND hook wraps
    "sglang.srt.models.llama.LlamaModel.forward",
    "sglang.srt.models.qwen2.Qwen2Model.forward",
    "sglang.srt.models.qwen3.Qwen3Model.forward",
)


class Rotary(NamedTuple):
    """Tokens' positions and their rows of SGLang's cos/sin cache, gathered once per stage."""

    positions: torch.Tensor
    cos_sin: torch.Tensor


def rotary_table(causal_lm) -> torch.Tensor | None:
    """The cos/sin table its first layer's `rotary_emb` applies ([positions, rotary_dim]: cos,
    then sin) of an SGLang causal LM (LlamaForCausalLM, ...); None for a model laid out otherwise."""
    decoder = getattr(causal_lm, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        return None
    attention = getattr(layers[getattr(decoder, "start_layer", 0)], "self_attn", None)
    return getattr(getattr(attention, "rotary_emb", None), "cos_sin_cache", None)


class SGLangLayers:
    """Layer-at-a-time access to an SGLang decoder (LlamaModel, Qwen2Model, Qwen3Model)."""

    def __init__(self, model, forward_batch):
        self.model = model
        self.layers = model.layers[model.start_layer:model.end_layer]
        self.num_layers = len(self.layers)
        self.forward_batch = forward_batch

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def rotary(self, positions: torch.Tensor) -> Rotary:
        cache = self.layers[0].self_attn.rotary_emb.cos_sin_cache
        return Rotary(positions, cache.index_select(0, positions))

    def qkv(self, layer: int, hidden: torch.Tensor, rotary: Rotary):
        block = self.layers[layer]
        attn, radix = block.self_attn, block.self_attn.attn
        x = block.input_layernorm(hidden)
        # SGLang's native rotary reads a precomputed cos/sin table from `sin_cos_cache` when set
        attn.rotary_emb.sin_cos_cache = rotary.cos_sin
        try:
            if hasattr(attn, "forward_prepare_native"):  # Llama, Qwen3 (per-head q/k norm inside)
                q, k, v = attn.forward_prepare_native(rotary.positions, x)
            else:  # Qwen2
                qkv, _ = attn.qkv_proj(x)
                q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
                q, k = attn.rotary_emb(rotary.positions, q, k)
        finally:
            del attn.rotary_emb.sin_cos_cache
        return (q.reshape(-1, radix.tp_q_head_num, radix.qk_head_dim),
                k.reshape(-1, radix.tp_k_head_num, radix.qk_head_dim),
                v.reshape(-1, radix.tp_v_head_num, radix.v_head_dim))

    def attention_scale(self, layer: int) -> float:
        return self.layers[layer].self_attn.attn.scaling

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        out, _ = block.self_attn.o_proj(attn)
        hidden = hidden + out
        return hidden + block.mlp(block.post_attention_layernorm(hidden), forward_batch=self.forward_batch)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)


class PoolKV:
    """SGLang's token-to-KV pool seen through the model's layers (layer ids are the pool's)."""

    def __init__(self, pool, layers: SGLangLayers):
        self.pool = pool
        self.radix = [block.self_attn.attn for block in layers.layers]

    def keys(self, layer: int) -> torch.Tensor:
        return self.pool.get_key_buffer(self.radix[layer].layer_id)

    def values(self, layer: int) -> torch.Tensor:
        return self.pool.get_value_buffer(self.radix[layer].layer_id)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.set_kv_buffer(self.radix[layer], slots, k, v)
