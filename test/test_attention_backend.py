"""The `tokendance` attention backend (srt/attention.py) on SGLang's own pools, in-process:
fed the same q/k/v as SGLang's torch_native backend (K rotated by the model), it keeps K
un-rotated in its pool and returns torch_native's outputs, for a prefill, a chunk after a
prefix (a radix hit or chunked prefill) and decode steps of a mixed batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_tokendance.core.rope import RopeSpec, rotate
from sglang_tokendance.bench.tiny_models import tiny_config

HEADS, KV_HEADS, D = 4, 2, 16


@pytest.fixture(scope="module")
def sglang_parts():
    from sglang_tokendance import cpu

    cpu.prepare_process()
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_tokendance.srt.attention import TokenDanceAttnBackend

    return SimpleNamespace(torch_native=TorchNativeAttnBackend, tokendance=TokenDanceAttnBackend,
                           pool=MHATokenToKVPool, rows=ReqToTokenPool, mode=ForwardMode, attn_type=AttentionType)


class Runner:
    """What an attention backend takes from SGLang's ModelRunner: its pools, device, config."""

    def __init__(self, parts, config):
        self.device = "cpu"
        self.model_config = SimpleNamespace(hf_config=config)
        self.req_to_token_pool = parts.rows(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        self.token_to_kv_pool = parts.pool(size=128, page_size=1, dtype=torch.float32, head_num=KV_HEADS,
                                           head_dim=D, layer_num=1, device="cpu", enable_memory_saver=False)


def batch(mode, rows: list[int], starts: list[int], ends: list[int], slots: torch.Tensor):
    """A ForwardBatch's fields for requests in req_to_token rows `rows` computing positions
    [starts[b], ends[b]) in slots `slots` (flattened)."""
    positions = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)])
    fields = dict(forward_mode=mode, req_pool_indices=torch.tensor(rows), req_pool_indices_cpu=torch.tensor(rows),
                  seq_lens=torch.tensor(ends),
                  seq_lens_cpu=torch.tensor(ends), positions=positions, out_cache_loc=slots, encoder_lens=None)
    if mode.is_extend():
        counts = [e - s for s, e in zip(starts, ends)]
        fields |= dict(extend_prefix_lens=torch.tensor(starts), extend_seq_lens=torch.tensor(counts),
                       extend_prefix_lens_cpu=starts, extend_seq_lens_cpu=counts)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("arch,scaling", [("llama", None), ("qwen2", None),
                                          ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16})])
def test_tokendance_backend_equals_torch_native(sglang_parts, arch, scaling):
    parts = sglang_parts
    config = tiny_config(arch)
    if scaling is not None:
        config.rope_parameters = {**config.rope_parameters, **scaling}
    spec = RopeSpec.from_hf_config(config)
    assert spec.scaling.type == (scaling or {}).get("rope_type", "default")
    reference, mirror = Runner(parts, config), Runner(parts, config)
    backends = parts.torch_native(reference), parts.tokendance(mirror)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS,
                            qk_head_dim=D, v_head_dim=D, scaling=D ** -0.5, is_cross_attention=False,
                            attn_type=parts.attn_type.DECODER, sliding_window_size=-1)
    gen = torch.Generator().manual_seed(0)
    free = iter(torch.randperm(120, generator=gen) + 1)
    rows, lengths = [1, 3], [0, 0]

    def step(mode, ends: list[int]) -> None:
        starts = [lengths[b] for b in range(len(rows))]
        n = sum(e - s for s, e in zip(starts, ends))
        slots = torch.stack([next(free) for _ in range(n)])
        fb = batch(mode, rows, starts, ends, slots)
        for runner in (reference, mirror):
            table = runner.req_to_token_pool.req_to_token
            at = 0
            for b, (s, e) in enumerate(zip(starts, ends)):
                table[rows[b], s:e] = slots[at:at + e - s].to(table.dtype)
                at += e - s
        q = torch.randn(n, HEADS * D, generator=gen)
        k = rotate(torch.randn(n, KV_HEADS, D, generator=gen), fb.positions, spec)  # the model rotates K
        v = torch.randn(n, KV_HEADS, D, generator=gen)
        outs = []
        for backend in backends:
            backend.init_forward_metadata(fb)
            forward = backend.forward_extend if mode.is_extend() else backend.forward_decode
            outs.append(forward(q.clone(), k.clone(), v.clone(), layer, fb))
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
        lengths[:] = ends

    step(parts.mode.EXTEND, [9, 20])  # two prefills
    step(parts.mode.EXTEND, [12, 40])  # chunks after a prefix: packed and causal grids
    for _ in range(3):
        step(parts.mode.DECODE, [lengths[0] + 1, lengths[1] + 1])
    stored = mirror.token_to_kv_pool.get_key_buffer(0)
    rotated = reference.token_to_kv_pool.get_key_buffer(0)
    row = mirror.req_to_token_pool.req_to_token[rows[1], :lengths[1]].to(torch.int64)
    assert not torch.allclose(stored[row[1:]], rotated[row[1:]], atol=1e-3)  # the pool keeps K un-rotated...
    torch.testing.assert_close(rotate(stored[row], torch.arange(row.numel()), spec), rotated[row],
                               atol=1e-5, rtol=1e-5)  # ...which is SGLang's K rotated back
