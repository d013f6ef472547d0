"""Chunked prefill's selection, made once over the whole prompt at its first blended chunk.

Under `--chunked-prefill-size` SGLang forwards a long prompt in pieces. Selecting per chunk
(each chunk's own probe and top share) splits the request's budget evenly over its chunks and
ranks each chunk's tokens without the attention of the prompt's later tokens: 1.18-1.35x the
unchunked decode KL at N=4 in chunks of 128 and 64 tokens (benchmark/results/quality_chunked.md).
With planned selection (`--tokendance-planned-selection`, the default) the first chunk that
reads Masters and is not the prompt's last also probes the rest of the prompt: layers 0..c
over scratch KV (core/dense_kv, the probe layers only) holding the radix prefix and every
Master run at the reader's positions, the fresh tokens computed there -- the probe an
unchunked prefill would run. Its choice becomes the request's `PromptSelection`
(srt/reuse.RequestReuse.selection), with the probe's states of the tokens it computed (fresh
and kept: their hidden states after layer c and their KV of layers 0..c, core/blend
`carried_states`). Every chunk, this one included, then writes its computed tokens' probe KV and
runs them on from layer c+1 (core/blend RequestRow.resumed): no probe, no layer computed twice,
the unchunked prefill's answer and work; a chunk that reads no Master is forwarded the same
way. The chunk reads only the runs the choice covered. Whether blending pays was weighed for
the whole rest of the prompt when its first reading chunk was planned, as an unchunked prefill
weighs it (srt/reuse `RequestReuse.plan_chunk`), and is not weighed again.

A Master evicted between chunks makes its run computed in full, from the first layer (the
chunk's computed tokens are then not the planned ones: nothing is resumed there); a Master
superseded between chunks changes what a chunk reads at layers above c, not which tokens were
chosen. Under dense write-back (`--no-tokendance-sparse-writeback`) nothing is carried: the
chunks compute their kept and fresh tokens from the first layer. The request holds the states
until its prompt's last chunk has run: hidden size plus (c+1) layers of K and V per computed
token, outside SGLang's KV pool. The probe runs in one scheduler step, so only a rest whose
probe costs at most one prefill chunk through every layer is planned (srt/forest
`probe_limit`: chunk size x layers / (c+1) tokens, the chunk at least 8192 tokens; its scratch
then holds at most one such chunk's KV); a longer rest is selected chunk by chunk.
"""

from __future__ import annotations

import torch

from sglang_tokendance.core.blend import carried_states, probe, select
from sglang_tokendance.core.blend_types import BlendOptions, RequestRow, ReusedRun
from sglang_tokendance.core.dense_kv import DenseKV
from sglang_tokendance.core.plan import PromptSelection
from sglang_tokendance.core.segment_table import SegmentTable
from sglang_tokendance.core.selection import SelectionRule
from sglang_tokendance.srt.model import PoolKV, SGLangLayers
from sglang_tokendance.srt.reuse import ChunkPlan, master_slots
from sglang_tokendance.srt.storage import MasterStorage


def needs_selection(plan: ChunkPlan, options: BlendOptions) -> bool:
    """Whether the chunk `plan` should choose for its whole prompt: it reads Masters, is not the
    prompt's last chunk, nothing was chosen yet, and the ratio (or a fidelity budget) leaves a
    choice to make, per request (a round group's aligned selection chooses with the group,
    chunk by chunk)."""
    prompt_len = len(plan.request.req.origin_input_ids)
    return (options.chooses_per_request(plan.max_approximate) and plan.request.selection is None
            and bool(plan.runs) and plan.prefix_len + plan.extend_len < prompt_len)


@torch.no_grad()
def select_prompt(plan: ChunkPlan, table: SegmentTable, storage: MasterStorage, layers: SGLangLayers, pool: PoolKV,
                  row: torch.Tensor, options: BlendOptions, rule: SelectionRule) -> PromptSelection:
    """The selection of the prompt from `plan`'s chunk on (its row's slots `row` hold the radix
    prefix), with the probe's states for the chunks to resume. The chunk's own runs are
    `plan`'s; the later ones are looked up. (Whether blending the rest pays was weighed when
    the chunk was planned: srt/reuse `RequestReuse.plan_chunk`.)"""
    state, start = plan.request, plan.prefix_len
    prompt_len = len(state.req.origin_input_ids)
    runs = plan.runs + state.runs_in(table, start + plan.extend_len, prompt_len).runs
    device = row.device
    k0 = pool.keys(0)
    scratch = DenseKV(options.check_layer + 1, prompt_len, k0.shape[1], k0.shape[2], dtype=k0.dtype, device=device)
    prefix = torch.arange(start, device=device)
    masters = master_slots(runs)
    at = torch.cat([torch.arange(run.start, run.end, device=device) for run in runs])
    for layer in range(options.check_layer + 1):
        pool_layer = pool.radix[layer].layer_id
        scratch.write(layer, prefix, *storage.read_at(pool_layer, row[:start].to(torch.int64), prefix, False))
        scratch.write(layer, at, *storage.read_at(pool_layer, masters.to(device), at, True))
    ids = torch.tensor(state.req.origin_input_ids[start:], device=device)
    request = RequestRow(start, prompt_len - start, torch.arange(prompt_len, device=device),
                         [ReusedRun(run.start - start, run.end - start, run.segment_offset, run.master.key)
                          for run in runs], max_approximate=plan.max_approximate)
    checked = probe(layers, scratch, ids, torch.arange(start, prompt_len, device=device), [request], rule, options)
    kept = select(checked, rule, options)
    return PromptSelection.of(start, prompt_len, runs, kept, carried_states(checked, kept, scratch, options))
