"""The collective blended prefill (core/blend + core/selection + core/collective.share_runs) on a
tiny random Llama: a round group's members read the same cached segments, each at its own
offset, in one extend batch. Group-aligned selection keeps one set of segment offsets for
every member; a shared probe probes a shared segment in only the first k members and computes
the others' kept tokens afterwards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_tokendance.bench.hf_layerwise import HFLayerwise, full_prefill
from sglang_tokendance.core.dense_kv import DenseKV
from sglang_tokendance.core.blend import blended_prefill
from sglang_tokendance.core.blend_types import BlendOptions, ReusedRun, RequestRow
from sglang_tokendance.core.collective import GroupRun, share_runs
from sglang_tokendance.core.rope import RopeSpec, rotate, unrotate
from sglang_tokendance.core.selection import ReusedSegment, rule_named, select_kept
from test_blend_golden import tiny

C = 2  # check layer (the tiny models have 4 layers)
PER_REQUEST = BlendOptions(recompute_ratio=0.3, check_layer=C)
ALIGNED = dataclasses.replace(PER_REQUEST, group_selection="aligned")
SHARED_PROBE = dataclasses.replace(ALIGNED, group_probe=1)
SCREENED = dict(check_layer=3, screen_layer=1)
RULE = rule_named("attention-kv")


@pytest.fixture(scope="module")
def model() -> HFLayerwise:
    return tiny("llama")


def rand(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


class Round:
    """`members` prompts: a private history, the segments (each member its own rotation of
    them), a private suffix; each segment's KV cached un-rotated in its author's context."""

    def __init__(self, model: HFLayerwise, members: int = 3, shared: bool = True, group="round"):
        spec = RopeSpec.from_hf_config(model.lm.config)
        lengths = {"A": 18, "B": 14}
        texts, cached = {}, {}
        # without sharing every member reads segments of its own
        keys = [[(name, 0 if shared else m) for name in lengths] for m in range(members)]
        for seed, key in enumerate(sorted({k for ks in keys for k in ks})):
            texts[key] = rand(lengths[key[0]], 300 + seed)
            author = rand(5 + seed % 4, 500 + seed)
            _, kv = full_prefill(model, torch.cat([author, texts[key]]))
            at = torch.arange(author.numel(), author.numel() + texts[key].numel())
            cached[key] = [(unrotate(kv.keys(layer)[at], at, spec), kv.values(layer)[at])
                           for layer in range(model.num_layers)]
        self.ids, self.positions, self.rows, self.prompts = [], [], [], []
        base = 0
        for m in range(members):
            order = keys[m][m % 2:] + keys[m][:m % 2]
            pieces, runs = [rand(4 + 2 * m, 100 + m)], []
            for key in order:
                start = sum(p.numel() for p in pieces)
                pieces.append(texts[key])
                runs.append(ReusedRun(start, start + texts[key].numel(), 0, key))
            pieces.append(rand(5, 200 + m))
            prompt = torch.cat(pieces)
            self.prompts.append(prompt)
            self.ids.append(prompt)
            self.positions.append(torch.arange(prompt.numel()))
            self.rows.append(RequestRow(0, prompt.numel(), torch.arange(base, base + prompt.numel()), runs, group))
            base += prompt.numel()
        self.kv = DenseKV(model.num_layers, base, *model.kv_shape())
        for row in self.rows:
            for run in row.reused:
                slots = row.slots[run.start:run.end]
                at = torch.arange(run.start, run.end)
                for layer, (k, v) in enumerate(cached[run.segment]):
                    self.kv.write(layer, slots, rotate(k, at, spec), v)

    def run(self, model, options: BlendOptions, rows=None):
        """The batch's blended prefill."""
        kv = self.kv.clone()
        hidden, stats = blended_prefill(model, kv, torch.cat(self.ids), torch.cat(self.positions),
                                        rows or self.rows, options, RULE)
        return hidden, stats, kv

    def kept_offsets(self, kept: torch.Tensor) -> list[set]:
        """Per member, the (segment, offset) of its kept tokens."""
        out, at = [], 0
        for row in self.rows:
            offsets = set()
            for run in row.reused:
                n = run.end - run.start
                offsets |= {(run.segment, int(i)) for i in kept[at:at + n].nonzero().squeeze(1)}
                at += n
            out.append(offsets)
        return out


def ungrouped(rows: list[RequestRow]) -> list[RequestRow]:
    return [dataclasses.replace(r, group=None) for r in rows]


def assert_same(a, b) -> None:
    (ha, sa, kva), (hb, sb, kvb) = a, b
    assert torch.equal(sa.kept, sb.kept) and sa.token_layers == sb.token_layers
    assert torch.equal(ha, hb) and torch.equal(kva.k, kvb.k) and torch.equal(kva.v, kvb.v)


@torch.no_grad()
@pytest.mark.parametrize("options", [ALIGNED, SHARED_PROBE], ids=["aligned", "shared-probe"])
def test_a_group_of_one_is_per_request(model, options):
    one = Round(model, members=1)
    assert_same(one.run(model, options), one.run(model, PER_REQUEST))


@torch.no_grad()
@pytest.mark.parametrize("options", [ALIGNED, SHARED_PROBE], ids=["aligned", "shared-probe"])
def test_members_sharing_no_segment_are_per_request_exactly(model, options):
    apart = Round(model, shared=False)
    assert_same(apart.run(model, options), apart.run(model, PER_REQUEST))


@torch.no_grad()
@pytest.mark.parametrize("options", [ALIGNED, SHARED_PROBE], ids=["aligned", "shared-probe"])
def test_requests_without_a_group_are_per_request(model, options):
    together = Round(model)
    assert_same(together.run(model, options, ungrouped(together.rows)), together.run(model, PER_REQUEST))


@torch.no_grad()
@pytest.mark.parametrize("screen", [{}, SCREENED], ids=["unscreened", "screened"])
@pytest.mark.parametrize("options", [ALIGNED, SHARED_PROBE], ids=["aligned", "shared-probe"])
def test_ratio_one_is_a_full_prefill(model, options, screen):
    together = Round(model)
    hidden, stats, _ = together.run(model, dataclasses.replace(options, recompute_ratio=1.0, **screen))
    at = 0
    for prompt in together.prompts:
        full, _ = full_prefill(model, prompt)
        torch.testing.assert_close(hidden[at:at + prompt.numel()], full, atol=1e-4, rtol=1e-4)
        at += prompt.numel()
    assert stats.kept_tokens == stats.reused_tokens


@torch.no_grad()
@pytest.mark.parametrize("screen", [{}, SCREENED], ids=["unscreened", "screened"])
@pytest.mark.parametrize("options", [ALIGNED, SHARED_PROBE], ids=["aligned", "shared-probe"])
def test_aligned_selection_keeps_the_same_offsets_in_every_member(model, options, screen):
    together = Round(model)
    options = dataclasses.replace(options, **screen)
    _, stats, _ = together.run(model, options)
    offsets = together.kept_offsets(stats.kept)
    assert offsets[0] and all(o == offsets[0] for o in offsets)
    members = len(offsets)  # the group's budget, taken in units of one offset in every member
    assert stats.kept_tokens == members * len(offsets[0])
    assert abs(stats.kept_tokens - 0.3 * stats.reused_tokens) < members
    _, own, _ = together.run(model, dataclasses.replace(PER_REQUEST, **screen))
    assert len({frozenset(o) for o in together.kept_offsets(own.kept)}) > 1  # per request they differ


@torch.no_grad()
def test_shared_probe_probes_a_shared_segment_in_one_member_only(model):
    """Token-layers: layers 0..c on everything but the adopted tokens, 0..c again on the
    adopted tokens kept, c+1..L-1 on the fresh and kept tokens."""
    together = Round(model)
    tokens = sum(p.numel() for p in together.prompts)
    reused = sum(run.end - run.start for row in together.rows for run in row.reused)
    adopted = sum(run.end - run.start for row in together.rows[1:] for run in row.reused)
    _, stats, kv = together.run(model, SHARED_PROBE)
    assert stats.reused_tokens == reused and stats.adopted_tokens == adopted
    kept_adopted = int(stats.kept[reused - adopted:].sum())
    fresh = tokens - reused
    assert kept_adopted == 2 * int(stats.kept[:reused - adopted].sum())  # the prober's choice, twice
    layers = model.num_layers
    assert stats.token_layers == (tokens - adopted + kept_adopted) * (C + 1) + \
        (fresh + stats.kept_tokens) * (layers - C - 1)
    _, per_request, _ = together.run(model, PER_REQUEST)
    assert per_request.token_layers == tokens * (C + 1) + (fresh + per_request.kept_tokens) * (layers - C - 1)
    # sparse write-back: a member's KV differs from the cached segments exactly at its kept tokens
    reused_slots = torch.cat([row.slots[run.start:run.end] for row in together.rows for run in row.reused])
    for layer in range(layers):
        changed = (kv.k[layer, reused_slots] != together.kv.k[layer, reused_slots]).flatten(1).any(1)
        assert torch.equal(changed, stats.kept), layer


@torch.no_grad()
@pytest.mark.parametrize("options", [PER_REQUEST, ALIGNED, SHARED_PROBE], ids=["per-request", "aligned", "shared"])
def test_outputs_are_deterministic(model, options):
    together = Round(model)
    assert_same(together.run(model, options), together.run(model, options))


def test_pools_share_a_budget_and_ignore_missing_scores():
    """Two requests reading one segment: its units are ranked by the mean of the scores they
    have (NaN: none) and kept in both; a run of a segment nobody else reads stays per request."""
    shared = ("g", ("S", 0))
    requests = [[ReusedSegment(0, 4, 0, shared), ReusedSegment(4, 8)], [ReusedSegment(8, 12, 0, shared)]]
    scores = torch.tensor([1.0, 9.0, 2.0, 0.0, 5.0, 0.0, 0.0, 0.0, 3.0, float("nan"), 8.0, 0.0])
    kept = select_kept(scores, requests, [0.25, 0.25])
    # shared units: means 2, 9, 5, 0 (NaN ignored) -> budget round(0.25 * 8) = 2 tokens -> unit 1 in both
    # the first request's own run [4, 8): budget 1 -> token 4
    assert kept.nonzero().squeeze(1).tolist() == [1, 4, 9]
    blocks = select_kept(scores, requests, [0.5, 0.5], granularity="block", block_size=2)
    assert blocks.nonzero().squeeze(1).tolist() == [0, 1, 4, 5, 8, 9]


def test_share_runs_tags_shared_segments_and_picks_probers():
    runs = [[GroupRun("A", 0, 10), GroupRun("B", 0, 5), GroupRun(None, 0, 3)],
            [GroupRun("A", 0, 10), GroupRun("C", 0, 4)],
            [GroupRun("A", 2, 8), GroupRun("A", 0, 10)],  # A twice: its first read is (A, 0)
            [GroupRun("A", 0, 10)]]
    keys, adopted = share_runs(["g", "g", "g", None], runs, probers=1)
    a0 = ("g", ("A", 0))
    assert keys == [[a0, None, None], [a0, None], [a0, None], [None]]
    assert adopted == [[False, False, False], [True, False], [True, False], [False]]
    keys, adopted = share_runs(["g", "g", "g", None], runs, probers=2)
    assert adopted == [[False, False, False], [False, False], [True, False], [False]]
    late = [[GroupRun("A", 10, 10)], [GroupRun("A", 0, 20)]]  # the later member holds more of A
    assert share_runs(["g", "g"], late, probers=1)[1] == [[False], [False]]


def test_bad_group_options():
    with pytest.raises(ValueError, match="group selection"):
        BlendOptions(group_selection="best")
    with pytest.raises(ValueError, match="aligned"):
        BlendOptions(group_probe=1)


def test_zero_copy_under_a_shared_probe_writes_kept_adopted_tokens_into_their_own_slots(model):
    """Master-Mirror zero copy with a shared probe: rows read the segments' Master slots in
    place, at a shift; the kept tokens -- the adopted ones caught up after the check included -- are
    computed into their own slots, exactly what the copying run writes there; Masters are
    never written."""
    from test_blend_golden import kept_in_own_slots, zero_copy_batch

    together = Round(model)
    spec = RopeSpec.from_hf_config(model.lm.config)
    pool = together.kv
    ids, positions = torch.cat(together.ids), torch.cat(together.positions)
    copied = pool.clone()
    want, want_stats = blended_prefill(model, copied, ids, positions, together.rows, SHARED_PROBE, RULE)
    zero_rows, zero_pool, master_slots, reads = zero_copy_batch(together.rows, pool, spec, SHARED_PROBE)
    kv = zero_pool.clone()
    got, stats = blended_prefill(model, kv, ids, positions, zero_rows, SHARED_PROBE, RULE, reads)
    assert stats.adopted_tokens > 0 and bool((stats.kept & stats.adopted).any())
    assert torch.equal(stats.kept, want_stats.kept) and stats.token_layers == want_stats.token_layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv.k[:, master_slots], zero_pool.k[:, master_slots])
    own, at, _, spare = kept_in_own_slots(together.rows, zero_rows, stats.kept)
    caught = (stats.kept & stats.adopted)[stats.kept]  # of the kept tokens, those that skipped the probe
    assert caught.any()
    torch.testing.assert_close(kv.k[:, own[caught]], copied.k[:, at[caught]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.v[:, own], copied.v[:, at], atol=1e-5, rtol=1e-5)
    assert not kv.k[:, spare].any()
