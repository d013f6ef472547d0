"""Planned selection under chunked prefill (srt/prompt_selection.py) without a server: the first
blended chunk's choice over the whole prompt is the unchunked blended prefill's choice, under
dense and mirror storage; later chunks read only what it covered and recompute their part."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from sglang_tokendance.bench.hf_layerwise import HFLayerwise, full_prefill
from sglang_tokendance.bench.tiny_models import tiny_layerwise
from sglang_tokendance.core.blend import probe, select
from sglang_tokendance.core.blend_types import BlendOptions, RequestRow, ReusedRun
from sglang_tokendance.core.dense_kv import DenseKV
from sglang_tokendance.core.rope import RopeSpec, rerotate, unrotate
from sglang_tokendance.core.segment_table import SegmentTable
from sglang_tokendance.core.segments import SegmentSpan
from sglang_tokendance.core.selection import rule_named
from sglang_tokendance.core.slot_frames import SlotFrames
from sglang_tokendance.srt.kv_copy import PoolKeys
from sglang_tokendance.srt.prompt_interface import CARRIER_KEY
from sglang_tokendance.srt.prompt_selection import needs_selection, select_prompt
from sglang_tokendance.srt.request import RequestOptions
from sglang_tokendance.srt.reuse import RequestReuse
from sglang_tokendance.srt.storage import MasterStorage

PROMPT_LEN, PREFIX, CHUNK = 90, 4, 24
SPANS = [SegmentSpan(10, 34, "a"), SegmentSpan(40, 70, "b"), SegmentSpan(72, 86, "c")]
OPTIONS = BlendOptions(recompute_ratio=0.3, check_layer=2, screen_layer=1)
AUTHOR_SHIFT = 7  # mirror storage: each Master's author wrote it this far before the reader's position


@pytest.fixture(scope="module")
def model() -> HFLayerwise:
    return tiny_layerwise("llama")


def fake_req(ids: list[int]):
    payload = {"segments": [vars(s) for s in SPANS]}
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params={CARRIER_KEY: json.dumps(payload)}),
                           origin_input_ids=ids, extra_key=None, cache_salt=None, customized_info=None,
                           prefix_len=PREFIX)


class Pool:
    """SGLang's KV pool as MasterStorage and PoolKV read it (layer ids are the model's)."""

    def __init__(self, kv: DenseKV):
        self.kv = kv

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.kv.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.kv.v[layer]


class Setup:
    """A prompt whose radix prefix and blocks sit in a pool: the prefix exact at the row's
    slots, each block's Master computed in another context (the blocks in another order)."""

    def __init__(self, model: HFLayerwise, mirror: bool):
        gen = torch.Generator().manual_seed(3)
        self.ids = torch.randint(3, 512, (PROMPT_LEN,), generator=gen)
        self.spec = RopeSpec.from_hf_config(model.lm.config)
        _, exact = full_prefill(model, self.ids)
        layers, (heads, dim) = model.num_layers, model.kv_shape()
        block_slots = sum(s.end - s.start for s in SPANS)
        self.pool = DenseKV(layers, PROMPT_LEN + block_slots + 1, heads, dim)
        self.row = torch.randperm(PROMPT_LEN, generator=gen) + 1 + block_slots  # the request's own slots
        for layer in range(layers):
            self.pool.write(layer, self.row[:PREFIX], exact.keys(layer)[:PREFIX], exact.values(layer)[:PREFIX])
        frames = SlotFrames(self.pool.k.shape[1] - 1)
        frames.record(self.row, torch.arange(PROMPT_LEN))
        self.table, self.req = SegmentTable(), fake_req(self.ids.tolist())
        self.state = RequestReuse.of(self.req, RequestOptions.carried_by(self.req.sampling_params.custom_params),
                                     can_reuse=True, blend=OPTIONS)
        source = torch.cat([self.ids[s.start:s.end] for s in SPANS[::-1]] + [torch.randint(3, 512, (5,))])
        _, author = full_prefill(model, torch.cat([torch.randint(3, 512, (AUTHOR_SHIFT,)), source]))
        at, slot = AUTHOR_SHIFT, 1
        for span in SPANS[::-1]:
            n = span.end - span.start
            written, slots = torch.arange(at, at + n), torch.arange(slot, slot + n)
            for layer in range(layers):
                k = author.keys(layer)[written]
                self.pool.write(layer, slots, k if mirror else unrotate(k, written, self.spec),
                                author.values(layer)[written])
            frames.record(slots, written)
            self.table.insert(self.state.key(span.hash), slots, self.ids[span.start:span.end].tolist())
            at, slot = at + n, slot + n
        allocator = SimpleNamespace(get_kvcache=lambda: Pool(self.pool), frames=frames)
        self.storage = MasterStorage(PoolKeys(self.spec), allocator, None, None, zero_copy=mirror)
        self.pool_kv = SimpleNamespace(radix=[SimpleNamespace(layer_id=layer) for layer in range(layers)],
                                       keys=self.pool.keys)
        self.author = author

    def unchunked_choice(self, model: HFLayerwise) -> tuple[torch.Tensor, torch.Tensor]:
        """The blended prefill's selection over the whole prompt (one forward after the
        prefix), over a row holding the prefix and every block's Master at its position; and
        the reused positions in order."""
        kv = DenseKV(model.num_layers, PROMPT_LEN, *model.kv_shape())
        for layer in range(model.num_layers):
            kv.write(layer, torch.arange(PREFIX), self.pool.k[layer, self.row[:PREFIX]],
                     self.pool.v[layer, self.row[:PREFIX]])
        runs, at = [], AUTHOR_SHIFT
        for span in SPANS[::-1]:
            n = span.end - span.start
            where = torch.arange(span.start, span.end)
            for layer in range(model.num_layers):
                kv.write(layer, where, rerotate(self.author.keys(layer)[at:at + n], torch.arange(at, at + n), where,
                                                self.spec), self.author.values(layer)[at:at + n])
            at += n
        last = PROMPT_LEN - 1
        for span in SPANS:
            runs.append(ReusedRun(span.start - PREFIX, min(span.end, last) - PREFIX, 0, self.state.key(span.hash)))
        row = RequestRow(PREFIX, PROMPT_LEN - PREFIX, torch.arange(PROMPT_LEN), runs)
        rule = rule_named("attention-kv")
        checked = probe(model, kv, self.ids[PREFIX:], torch.arange(PREFIX, PROMPT_LEN), [row], rule, OPTIONS)
        positions = torch.cat([torch.arange(r.start, r.end) + PREFIX for r in runs])
        return select(checked, rule, OPTIONS), positions


@pytest.mark.parametrize("mirror", [False, True], ids=["dense", "mirror"])
@torch.no_grad()
def test_the_first_chunk_chooses_what_the_unchunked_prefill_chooses(model, mirror):
    setup = Setup(model, mirror)
    plan = setup.state.plan_chunk(setup.table, PREFIX, PREFIX + CHUNK)
    assert needs_selection(plan, OPTIONS)
    assert not needs_selection(plan, BlendOptions(recompute_ratio=0.0)) and not needs_selection(
        plan, BlendOptions(recompute_ratio=1.0, check_layer=2))
    assert needs_selection(dataclasses.replace(plan, max_approximate=10), BlendOptions(recompute_ratio=0.0))
    assert not needs_selection(plan, dataclasses.replace(OPTIONS, group_selection="aligned"))
    selection = select_prompt(plan, setup.table, setup.storage, model, setup.pool_kv, setup.row, OPTIONS,
                              rule_named("attention-kv"))
    want, positions = setup.unchunked_choice(model)
    assert torch.equal(selection.reused.nonzero().squeeze(1) + PREFIX, positions)
    assert torch.equal(selection.kept_at(positions), want)
    assert int(want.sum()) == round(0.3 * positions.numel()) and 0 < int(want[:plan.reused_tokens].sum())
    # the probe's states of every position it computes (fresh and kept), for the chunks to resume
    computed = (~selection.reused | selection.kept).nonzero().squeeze(1) + PREFIX
    assert torch.equal(selection.states.positions, computed)
    assert len(selection.states.keys) == OPTIONS.check_layer + 1
    assert selection.states.hidden.shape == (computed.numel(), model.lm.config.hidden_size)

    # the chunk that will choose for the rest weighs blending the whole rest, as an unchunked prefill would
    weighed = []
    cost = SimpleNamespace(options=OPTIONS, pays=lambda *args: weighed.append(args[:3]) or False)
    fresh = Setup(model, mirror)
    ahead = fresh.state.plan_chunk(fresh.table, PREFIX, PREFIX + CHUNK, cost=cost, plan_ahead=True)
    per_chunk = fresh.state.plan_chunk(fresh.table, PREFIX, PREFIX + CHUNK, cost=cost)
    assert weighed == [(PREFIX, PROMPT_LEN - PREFIX, positions.numel()), (PREFIX, CHUNK, plan.reused_tokens)]
    assert not ahead.runs and not per_chunk.runs and ahead.fell_back == plan.reused_tokens  # SGLang's path


@torch.no_grad()
def test_later_chunks_read_what_the_choice_covered_and_recompute_their_part(model):
    setup = Setup(model, mirror=False)
    first = setup.state.plan_chunk(setup.table, PREFIX, PREFIX + CHUNK)
    selection = select_prompt(first, setup.table, setup.storage, model, setup.pool_kv, setup.row, OPTIONS,
                              rule_named("attention-kv"))
    setup.state.selection = selection
    assert not needs_selection(first, OPTIONS)  # chosen once
    row = first.request_row(torch.arange(PREFIX + CHUNK))
    assert torch.equal(row.kept, selection.kept_at(first.positions(torch.device("cpu"))))
    computed = (~selection.reused[:CHUNK] | selection.kept[:CHUNK]).nonzero().squeeze(1) + PREFIX
    assert torch.equal(row.resumed.positions, computed)  # the chunk resumes its computed tokens' probe states
    setup.state.record_recomputed(first, int(row.kept.sum()), first.reused_tokens)
    # as if "c" had missed when the choice was made (cached since): not covered, so computed
    uncovered = selection.reused.clone()
    uncovered[72 - PREFIX:86 - PREFIX] = False
    setup.state.selection = dataclasses.replace(selection, reused=uncovered)
    never = SimpleNamespace(pays=lambda *args: False)  # a planned chunk is not weighed again
    second = setup.state.plan_chunk(setup.table, PREFIX + CHUNK, PROMPT_LEN, cost=never)
    assert second.selected and [(r.start, r.end) for r in second.runs] == [(28, 34), (40, 70)]
    second_row = second.request_row(torch.arange(PROMPT_LEN))
    kept = second_row.kept
    assert torch.equal(kept, selection.kept_at(second.positions(torch.device("cpu"))))
    assert second_row.resumed is None  # it computes "c" in full, which the probe did not: no states to resume
    setup.state.record_recomputed(second, int(kept.sum()), second.reused_tokens)
    assert setup.state.selection.states is None  # the prompt's last chunk ran: its states are spent
    counts = setup.state.counts
    assert counts.planned_tokens == first.reused_tokens + second.reused_tokens == 24 + 30
    assert counts.recomputed_tokens == int(row.kept.sum()) + int(kept.sum())
    setup.state.selection = selection  # as planned: the chunk reads "c" too and resumes its computed tokens
    as_planned = setup.state.plan_chunk(setup.table, PREFIX + CHUNK, PROMPT_LEN, cost=never)
    assert torch.equal(as_planned.request_row(torch.arange(PROMPT_LEN)).resumed.positions,
                       (~selection.reused[CHUNK:] | selection.kept[CHUNK:]).nonzero().squeeze(1) + PREFIX + CHUNK)
