"""The `tokendance` attention backend (srt/attention.py) on SGLang's own pools, in-process:
fed the same q/k/v as SGLang's torch_native backend (K rotated by the model), it runs SGLang's
own attention for rows that read nothing at a shift and core/rope_attention for a row that
reads a Master in place, returning what torch_native returns for a reader holding a copy."""

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

    def __init__(self, parts, config, kv_dtype: torch.dtype = torch.float32):
        self.device = "cpu"
        self.model_config = SimpleNamespace(hf_config=config)
        self.req_to_token_pool = parts.rows(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        self.token_to_kv_pool = parts.pool(size=128, page_size=1, dtype=kv_dtype, head_num=KV_HEADS,
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


LAYER = dict(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS, qk_head_dim=D,
             v_head_dim=D, scaling=D ** -0.5, is_cross_attention=False, sliding_window_size=-1)
AUTHOR, READER = 1, 3  # req_to_token rows
READ = (6, 18)  # the reader's positions [6, 18) read the author's slots at its positions [10, 22): shift -4
WRITTEN = (10, 22)


class Paths:
    """Which attention each row of each forward ran: SGLang's (`plain`, the rows' req_to_token
    indices) or the shifted path (`shifted`, how many rows)."""

    def __init__(self, backend, monkeypatch):
        import sglang_tokendance.srt.attention as module

        self.plain: list[list[int]] = []
        self.shifted: list[int] = []
        for name in ("_run_sdpa_forward_decode", "_run_sdpa_forward_extend"):
            original = getattr(backend, name)
            monkeypatch.setattr(backend, name, self._spy_plain(original))
        for name, q_at in (("tiled_decode_attention", 0), ("row_attention", 1)):
            monkeypatch.setattr(module, name, self._spy_shifted(getattr(module, name), q_at))

    def _spy_plain(self, original):
        def run(q, out, keys, values, table, index, *args, **kwargs):
            self.plain.append(index.tolist())
            return original(q, out, keys, values, table, index, *args, **kwargs)
        return run

    def _spy_shifted(self, original, q_at: int):
        def run(*args, **kwargs):
            self.shifted.append(args[q_at].shape[0])  # q's rows or tokens
            return original(*args, **kwargs)
        return run


@pytest.mark.parametrize("arch,scaling", [("llama", None), ("qwen2", None),
                                          ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16})])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_tokendance_backend_reads_masters_at_a_shift_and_runs_sglangs_attention_elsewhere(
        sglang_parts, arch, scaling, kv_dtype, monkeypatch):
    """A reader whose row points at an author's slots (a Master read in place at shift -4)
    gets what torch_native gives a reader holding its own copy of that KV rotated to its
    positions, for a chunk after that prefix and decode steps; rows without a shift -- every
    forward of the author, the author's row in a mixed decode batch -- run SGLang's own
    attention (bit-for-bit torch_native's outputs), and only the reader takes the shifted path.
    A KV cache of another dtype than the model's (`--kv-cache-dtype bfloat16` under float32) is
    read as torch_native reads it, cast to the query's."""
    from sglang_tokendance.core.rope import rerotate
    from sglang_tokendance.core.slot_frames import SlotFrames

    parts = sglang_parts
    config = tiny_config(arch)
    if scaling is not None:
        config.rope_parameters = {**config.rope_parameters, **scaling}
    spec = RopeSpec.from_hf_config(config)
    assert spec.scaling.type == (scaling or {}).get("rope_type", "default")
    reference, mirror = Runner(parts, config, kv_dtype), Runner(parts, config, kv_dtype)
    tolerance = 2e-5 if kv_dtype == torch.float32 else 3e-2  # the copies rounded to bfloat16 after rotating
    frames = SlotFrames(128)
    mirror.token_to_kv_pool_allocator = SimpleNamespace(frames=frames)
    backends = parts.torch_native(reference), parts.tokendance(mirror)
    paths = Paths(backends[1], monkeypatch)
    layer = SimpleNamespace(attn_type=parts.attn_type.DECODER, **LAYER)
    gen = torch.Generator().manual_seed(0)
    free = iter(torch.randperm(120, generator=gen) + 1)

    def forward(mode, rows: list[int], starts: list[int], ends: list[int]) -> torch.Tensor:
        n = sum(e - s for s, e in zip(starts, ends))
        slots = torch.stack([next(free) for _ in range(n)])
        fb = batch(mode, rows, starts, ends, slots)
        for runner in (reference, mirror):
            table, at = runner.req_to_token_pool.req_to_token, 0
            for row, s, e in zip(rows, starts, ends):
                table[row, s:e] = slots[at:at + e - s].to(table.dtype)
                at += e - s
        q = torch.randn(n, HEADS * D, generator=gen)
        k = rotate(torch.randn(n, KV_HEADS, D, generator=gen), fb.positions, spec)  # the model rotates K
        v = torch.randn(n, KV_HEADS, D, generator=gen)
        outs = []
        for backend in backends:
            backend.init_forward_metadata(fb)
            run = backend.forward_extend if mode.is_extend() else backend.forward_decode
            outs.append(run(q.clone(), k.clone(), v.clone(), layer, fb))
        torch.testing.assert_close(outs[1], outs[0], atol=tolerance, rtol=tolerance)
        return outs[1] - outs[0]

    # the author's prompt in two chunks: no shift anywhere, SGLang's attention bit for bit
    assert not forward(parts.mode.EXTEND, [AUTHOR], [0], [16]).any()
    assert not forward(parts.mode.EXTEND, [AUTHOR], [16], [30]).any()
    assert paths.shifted == [] and paths.plain == [[AUTHOR], [AUTHOR]]
    # the reader's first 18 positions: its own 0..5, then the author's slots (mirror) or a copy
    # of their KV rotated to 6..17 in slots of its own (reference)
    own, copies = torch.stack([next(free) for _ in range(6)]), torch.stack([next(free) for _ in range(12)])
    author = mirror.req_to_token_pool.req_to_token[AUTHOR, WRITTEN[0]:WRITTEN[1]].to(torch.int64)
    read_at, written_at = torch.arange(*READ), torch.arange(*WRITTEN)
    k_own = rotate(torch.randn(6, KV_HEADS, D, generator=gen), torch.arange(6), spec)
    v_own = torch.randn(6, KV_HEADS, D, generator=gen)
    for runner, masters in ((reference, copies), (mirror, author)):
        pool, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
        keys, values = pool.get_key_buffer(0), pool.get_value_buffer(0)
        keys[own], values[own] = k_own.to(kv_dtype), v_own.to(kv_dtype)
        table[READER, :6], table[READER, 6:18] = own.to(table.dtype), masters.to(table.dtype)
    ref_keys, ref_values = reference.token_to_kv_pool.get_key_buffer(0), reference.token_to_kv_pool.get_value_buffer(0)
    ref_keys[copies] = rerotate(ref_keys[author].float(), written_at, read_at, spec).to(kv_dtype)
    ref_values[copies] = ref_values[author]
    frames.record(own, torch.arange(6))
    assert torch.equal(frames.shifts(mirror.req_to_token_pool.req_to_token[READER, :18].to(torch.int64))[6:],
                       torch.full((12,), -4))
    forward(parts.mode.EXTEND, [READER], [18], [25])  # a chunk after the prefix that reads the Master
    assert paths.shifted == [7] and len(paths.plain) == 2
    for step in range(3):  # mixed decode batches: the author plain, the reader shifted
        forward(parts.mode.DECODE, [AUTHOR, READER], [30 + step, 25 + step], [31 + step, 26 + step])
    assert paths.shifted == [7, 1, 1, 1] and paths.plain[2:] == [[AUTHOR]] * 3
    # the mirror pool holds SGLang's K: the author's slots as the author wrote them, never rewritten
    torch.testing.assert_close(mirror.token_to_kv_pool.get_key_buffer(0)[author],
                               reference.token_to_kv_pool.get_key_buffer(0)[author], atol=0, rtol=0)
