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
(srt/reuse.RequestReuse.selection); every chunk, this one included, then computes its kept
tokens with its fresh ones and no probe (core/blend RequestRow.kept), reads only the runs the
choice covered, and skips the per-chunk cost check (the whole prompt's was weighed here, with
core/cost `plan_pays`; where planning would not pay, each chunk selects its own).

The price: the fresh and kept tokens run the probe layers twice (measured +0.15-0.2 of a full
prefill's work on SmolLM2 at check layer 8), and the first chunk's forward carries the whole
prompt's probe. Carrying the probe's states over to the later chunks would remove both (not
built). A Master superseded or evicted between chunks changes what a chunk reads (or makes it
compute those tokens), not which tokens were chosen.
"""

from __future__ import annotations

import torch

from sglang_tokendance.core.blend import BlendOptions, RequestRow, ReusedRun, probe, select
from sglang_tokendance.core.cost import PrefillCost
from sglang_tokendance.core.dense_kv import DenseKV
from sglang_tokendance.core.plan import PromptSelection
from sglang_tokendance.core.segment_table import SegmentTable
from sglang_tokendance.core.selection import SelectionRule
from sglang_tokendance.srt.model import PoolKV, SGLangLayers
from sglang_tokendance.srt.reuse import ChunkPlan
from sglang_tokendance.srt.storage import MasterStorage


def needs_selection(plan: ChunkPlan, options: BlendOptions) -> bool:
    """Whether the chunk `plan` should choose for its whole prompt: it reads Masters, is not the
    prompt's last chunk, nothing was chosen yet, and the ratio (or a fidelity budget) leaves a
    choice to make, per request (a round group's aligned selection chooses with the group,
    chunk by chunk)."""
    prompt_len = len(plan.request.req.origin_input_ids)
    chooses = (options.recompute_ratio > 0 or plan.max_approximate is not None) and not options.keeps_everything
    return (chooses and plan.request.selection is None and bool(plan.runs)
            and plan.prefix_len + plan.extend_len < prompt_len and options.group_selection == "per-request")


@torch.no_grad()
def select_prompt(plan: ChunkPlan, table: SegmentTable, storage: MasterStorage, layers: SGLangLayers, pool: PoolKV,
                  row: torch.Tensor, options: BlendOptions, rule: SelectionRule,
                  cost: PrefillCost | None) -> PromptSelection | None:
    """The selection of the prompt from `plan`'s chunk on (its row's slots `row` hold the radix
    prefix), or None where planning the rest of the prompt would not pay (core/cost
    `plan_pays`: then each chunk weighs and selects its own). The chunk's own runs are `plan`'s;
    the later ones are looked up."""
    state, start = plan.request, plan.prefix_len
    prompt_len = len(state.req.origin_input_ids)
    runs = plan.runs + state.runs_in(table, start + plan.extend_len, prompt_len).runs
    reused = sum(len(run) for run in runs)
    if cost is not None and not cost.plan_pays(start, prompt_len - start, reused, plan.max_approximate):
        return None
    device = row.device
    k0 = pool.keys(0)
    scratch = DenseKV(options.check_layer + 1, prompt_len, k0.shape[1], k0.shape[2], dtype=k0.dtype, device=device)
    prefix = torch.arange(start, device=device)
    masters = torch.cat([run.master.slots[run.segment_offset:run.segment_offset + len(run)] for run in runs])
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
    return PromptSelection.of(start, prompt_len, runs, select(checked, rule, options))
