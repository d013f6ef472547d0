"""core/blend + core/selection on tiny random HF models (every supported family), in-process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_tokendance.bench.hf_layerwise import HFLayerwise, full_prefill
from sglang_tokendance.core.dense_kv import DenseKV
from sglang_tokendance.core.blend import blended_prefill, finish, probe, select
from sglang_tokendance.core.blend_types import BlendOptions, RequestRow
from sglang_tokendance.core.rope import RopeSpec, rotate, unrotate
from sglang_tokendance.core.selection import (RULES, ReusedSegment, credited_allowance, fixed_scores, kept_share,
                                              most_kept, rule_named, select_kept)
from sglang_tokendance.bench.tiny_models import TINY_ARCHITECTURES, tiny_layerwise

SEG = (12, 30)  # the reused segment's place in the target prompt


def tiny(arch: str) -> HFLayerwise:
    return tiny_layerwise(arch)


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def model(request):
    return tiny(request.param)


def prompt(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(seed))


def cached_segment(model: HFLayerwise, ids: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-rotated K and V [layers, n, kv_heads, d] of ids[SEG] computed right after `context`."""
    source = torch.cat([context, ids[SEG[0]:SEG[1]]])
    _, kv = full_prefill(model, source)
    at = torch.arange(context.numel(), source.numel())
    spec = RopeSpec.from_hf_config(model.lm.config)
    layers = range(model.num_layers)
    k = torch.stack([unrotate(kv.keys(layer)[at], at, spec) for layer in layers])
    return k, torch.stack([kv.values(layer)[at] for layer in layers])


def reuse_row(model: HFLayerwise, ids: torch.Tensor, segment) -> tuple[DenseKV, RequestRow]:
    """A KV row for `ids` with the cached segment rotated into its place, as the forest does."""
    kv = DenseKV(model.num_layers, ids.numel(), *model.kv_shape())
    at = torch.arange(*SEG)
    spec = RopeSpec.from_hf_config(model.lm.config)
    for layer in range(model.num_layers):
        kv.write(layer, at, rotate(segment[0][layer], at, spec), segment[1][layer])
    return kv, RequestRow(0, ids.numel(), torch.arange(ids.numel()), reused=[SEG])


def logits(model, ids, kv, row, options, rule=None):
    hidden, stats = blended_prefill(model, kv, ids, torch.arange(ids.numel()), [row], options, rule)
    return model.logits(hidden[-1]), stats


def hf_logits(model: HFLayerwise, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.lm(ids.unsqueeze(0)).logits[0, -1]


@torch.no_grad()
def test_full_prefill_equals_hf(model):
    ids = prompt()
    hidden, _ = full_prefill(model, ids)
    torch.testing.assert_close(model.logits(hidden[-1]), hf_logits(model, ids), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_ratio_one_is_a_full_prefill(model):
    """Ratio 1 keeps every reused token whatever a rule would score: blended_prefill takes that
    short way (no probe) and must equal a full prefill."""
    ids = prompt()
    kv, row = reuse_row(model, ids, cached_segment(model, ids, prompt(2)[:7]))
    options = BlendOptions(recompute_ratio=1.0, check_layer=2)
    assert options.keeps_everything
    out, stats = logits(model, ids, kv, row, options, rule_named("attention-kv"))
    torch.testing.assert_close(out, hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert stats.kept_tokens == stats.reused_tokens == SEG[1] - SEG[0]
    assert stats.token_layers == stats.full_token_layers  # no probe layers on top


@torch.no_grad()
@pytest.mark.parametrize("screen", [0, 1])
def test_a_fidelity_budget_recomputes_all_but_that_many_reused_tokens(model, screen):
    """A row's max_approximate raises its kept share (even from ratio 0, which alone computes
    nothing reused); 0 leaves no token approximate: a full prefill's answer."""
    ids = prompt()
    segment = cached_segment(model, ids, prompt(2)[:7])
    n = SEG[1] - SEG[0]
    for ratio, bound, kept in ((0.0, None, 0), (0.0, 3, n - 3), (0.5, 3, n - 3), (0.9, 3, round(0.9 * n)),
                               (0.0, n, 0), (0.2, 0, n)):
        kv, row = reuse_row(model, ids, segment)
        options = BlendOptions(recompute_ratio=ratio, check_layer=2, screen_layer=screen)
        out, stats = logits(model, ids, kv, dataclasses.replace(row, max_approximate=bound), options,
                            rule_named("attention-kv"))
        assert stats.kept_tokens == kept, (ratio, bound)
        if kept == n:
            torch.testing.assert_close(out, hf_logits(model, ids), atol=1e-4, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("sparse", [True, False])
def test_the_probe_path_keeping_every_reused_token_is_a_full_prefill(model, rule, sparse):
    """The path every ratio below 1 takes -- probe with `rule` up to the check layer, write-back
    (sparse or not), then the kept tokens through the rest -- is exact when it keeps every
    reused token: the probe's KV of kept tokens is the full prefill's, whatever the rule."""
    ids = prompt()
    kv, row = reuse_row(model, ids, cached_segment(model, ids, prompt(2)[:7]))
    options = BlendOptions(recompute_ratio=0.5, check_layer=2, sparse_writeback=sparse)
    checked = probe(model, kv, ids, torch.arange(ids.numel()), [row], rule_named(rule), options)
    hidden, stats = finish(model, kv, checked, torch.ones(SEG[1] - SEG[0], dtype=torch.bool), options)
    torch.testing.assert_close(model.logits(hidden[-1]), hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert stats.kept_tokens == stats.reused_tokens == SEG[1] - SEG[0]


@torch.no_grad()
def test_reuse_from_another_context_is_approximate_and_recompute_helps(model):
    ids = prompt()
    segment = cached_segment(model, ids, prompt(2)[:7])
    full = hf_logits(model, ids).log_softmax(-1)

    def kl(ratio):
        kv, row = reuse_row(model, ids, segment)
        out, _ = logits(model, ids, kv, row, BlendOptions(recompute_ratio=ratio, check_layer=1),
                        rule_named("cacheblend-kv"))
        return torch.sum(full.exp() * (full - out.log_softmax(-1))).item()

    assert kl(0.0) > 1e-6  # the segment's KV really came from elsewhere
    assert kl(1.0) < 1e-6


@torch.no_grad()
def test_same_context_reuse_equals_full_prefill(model):
    ids = prompt()
    kv, row = reuse_row(model, ids, cached_segment(model, ids, ids[:SEG[0]]))
    out, stats = logits(model, ids, kv, row, BlendOptions(recompute_ratio=0.0), None)
    torch.testing.assert_close(out, hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert stats.token_layers == (ids.numel() - (SEG[1] - SEG[0])) * model.num_layers


@torch.no_grad()
def test_ratio_zero_computes_fresh_tokens_over_cached_kv(model):
    """Reference: the fresh tokens one at a time (decode-style), the segment's KV untouched."""
    ids = prompt()
    segment = cached_segment(model, ids, prompt(3)[:5])
    kv, row = reuse_row(model, ids, segment)
    out, _ = logits(model, ids, kv, row, BlendOptions(recompute_ratio=0.0), None)
    ref_kv, _ = reuse_row(model, ids, segment)
    for p in range(ids.numel()):
        if SEG[0] <= p < SEG[1]:
            continue
        step = RequestRow(prefix_len=p, num_tokens=1, slots=torch.arange(p + 1))
        hidden, _ = blended_prefill(model, ref_kv, ids[p:p + 1], torch.tensor([p]), [step], BlendOptions(), None)
    torch.testing.assert_close(out, model.logits(hidden[-1]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv.k, ref_kv.k, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@torch.no_grad()
def test_a_chunk_inside_reused_text_at_ratio_zero_computes_nothing(model):
    ids = prompt()
    kv, _ = reuse_row(model, ids, cached_segment(model, ids, prompt(2)[:7]))
    before = kv.k.clone(), kv.v.clone()
    chunk = torch.arange(SEG[0] + 2, SEG[1] - 2)  # a prefill chunk wholly inside the reused segment
    row = RequestRow(int(chunk[0]), chunk.numel(), torch.arange(ids.numel()), reused=[(0, chunk.numel())])
    hidden, stats = blended_prefill(model, kv, ids[chunk], chunk, [row], BlendOptions(), None)
    assert not hidden.any() and stats.token_layers == 0 and stats.reused_tokens == chunk.numel()
    assert torch.equal(kv.k, before[0]) and torch.equal(kv.v, before[1])


@pytest.mark.parametrize("sparse", [True, False])
def test_sparse_writeback_keeps_cached_kv_of_tokens_not_kept(sparse):
    model = tiny("llama")
    ids = prompt()
    kv, row = reuse_row(model, ids, cached_segment(model, ids, prompt(2)[:7]))
    cached_k = kv.k.clone()
    c, n = 1, SEG[1] - SEG[0]
    scores = torch.arange(n, dtype=torch.float32)  # keeps the segment's last tokens
    checked = probe(model, kv, ids, torch.arange(ids.numel()), [row], rule_named("cacheblend-k"),
                    BlendOptions(check_layer=c))
    kept = select_kept(scores, checked.batch.reused_segments(), [0.25])
    finish(model, kv, checked, kept, BlendOptions(recompute_ratio=0.25, check_layer=c, sparse_writeback=sparse))
    slots = torch.arange(*SEG)
    dropped, taken = slots[~kept], slots[kept]
    assert kept.sum() == round(0.25 * n) and kept[-1] and not kept[0]
    for layer in range(model.num_layers):
        same = torch.equal(kv.k[layer, dropped], cached_k[layer, dropped])
        assert same == (sparse or layer > c), layer
        assert not torch.equal(kv.k[layer, taken], cached_k[layer, taken])


def test_select_kept_budget_heads_and_blocks():
    segments = [[ReusedSegment(0, 10), ReusedSegment(10, 30)]]
    scores = torch.zeros(30)
    scores[[3, 25, 26]] = torch.tensor([5.0, 9.0, 7.0])
    kept = select_kept(scores, segments, [0.1])
    assert kept.nonzero().squeeze(1).tolist() == [3, 25, 26]
    kept = select_kept(scores, segments, [0.1], head_tokens=2)
    assert kept.nonzero().squeeze(1).tolist() == [0, 1, 10, 11]  # heads take the whole budget
    kept = select_kept(scores, segments, [0.2], granularity="block", block_size=8)
    # blocks are counted from each segment's start: [26, 30) and [18, 26) score best
    assert kept.nonzero().squeeze(1).tolist() == list(range(18, 30))
    assert select_kept(scores, segments, [1.0]).all()
    assert not select_kept(scores, segments, [0.0]).any()
    two = select_kept(torch.cat([scores, scores]), segments + [[ReusedSegment(30, 60)]], [0.1, 0.1])
    assert two[:30].sum() == 3 and two[30:].sum() == 3  # the budget is per request
    two = select_kept(torch.cat([scores, scores]), segments + [[ReusedSegment(30, 60)]], [0.1, 0.5])
    assert two[:30].sum() == 3 and two[30:].sum() == 15  # and so is the ratio
    with pytest.raises(ValueError, match="granularity"):
        select_kept(scores, segments, [0.1], granularity="page")
    with pytest.raises(ValueError, match="one ratio per request"):
        select_kept(scores, segments, [0.1, 0.1])


@given(ratio=st.floats(0.0, 1.0), reused=st.integers(0, 5000), bound=st.one_of(st.none(), st.integers(0, 5000)))
def test_kept_share_leaves_at_most_the_budget_approximate(ratio, reused, bound):
    share = kept_share(ratio, reused, bound)
    assert ratio <= share <= 1.0
    if bound is not None:
        assert reused - round(share * reused) <= bound  # the tokens select_kept leaves approximate
    if share > ratio:  # raised no further than the budget needs
        assert reused - round(share * reused) == bound


@given(ratio=st.sampled_from([0.0, 0.1, 0.15, 0.3, 0.7, 1.0]), reused=st.integers(1, 3000),
       credit=st.integers(0, 3000), bound=st.one_of(st.none(), st.integers(0, 3000)))
def test_credited_blocks_stay_in_the_recompute_budget(ratio, reused, credit, bound):
    """Block tokens a request holds exactly that it would otherwise reuse (exact recurrence)
    count in the pool its share is taken of: it recomputes ratio x (reused + credit) of its
    reused tokens (all at most), never fewer than the ratio alone or its own budget asks."""
    allowance = credited_allowance(ratio, reused, credit, bound)
    kept = round(kept_share(ratio, reused, allowance) * reused)
    alone = round(kept_share(ratio, reused, bound) * reused)
    assert kept >= alone
    if bound is None or reused - min(reused, round(ratio * (reused + credit))) <= bound:
        assert kept == min(reused, max(alone, round(ratio * (reused + credit))))
    else:  # the request's own budget asks for more
        assert kept == alone
    assert credited_allowance(ratio, reused, 0, bound) == bound  # no credit: nothing changes


@given(data=st.data(), share=st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.1, 0.15, 0.3, 0.7])),
       granularity=st.sampled_from(["token", "block"]),
       block_size=st.integers(1, 9), head_tokens=st.integers(0, 6))
def test_most_kept_bounds_what_select_kept_keeps_and_is_reached(data, share, granularity, block_size, head_tokens):
    """Zero-copy storage allocates a request's own slots before its forward for `most_kept`
    tokens: select_kept never keeps more, whatever the scores, runs and offsets (ties and
    unscored tokens included), and some scores make it keep exactly that many."""
    lengths = data.draw(st.lists(st.integers(1, 30), min_size=1, max_size=4))
    offsets = data.draw(st.lists(st.integers(0, 20), min_size=len(lengths), max_size=len(lengths)))
    segments, at = [], 0
    for n, offset in zip(lengths, offsets):
        segments.append(ReusedSegment(at, at + n, offset))
        at += n
    bound = most_kept(segments, share, granularity=granularity, block_size=block_size, head_tokens=head_tokens)
    kwargs = dict(granularity=granularity, block_size=block_size, head_tokens=head_tokens)
    scores = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.5, float("nan")]), min_size=at,
                                             max_size=at)))
    assert int(select_kept(scores, [segments], [share], **kwargs).sum()) <= bound
    reached = max(int(select_kept(torch.rand(at), [segments], [share], **kwargs).sum()) for _ in range(20))
    if granularity == "token" or block_size == 1:
        assert reached == bound  # tokens: the bound is exact


@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=8),
       share=st.sampled_from([0.1, 0.15, 0.3, 0.7, 0.9]))
def test_select_kept_keeps_what_most_kept_allocated_however_the_runs_are_split(lengths, share):
    """Own slots are allocated for `most_kept` before the forward, and the forward must not
    keep one token more: at decimal shares a sum of per-run products can round up where the
    product of the sum rounds down (0.1 x 1 + 0.1 x 24 against 0.1 x 25 = 2.5), which once
    crashed a server's prefill. Both count round(share x tokens), however the runs are split."""
    segments, at = [], 0
    for n in lengths:
        segments.append(ReusedSegment(at, at + n))
        at += n
    kept = int(select_kept(torch.rand(at), [segments], [share]).sum())
    assert kept == most_kept(segments, share) == round(share * at)


def test_a_segment_split_over_chunks_is_cut_like_the_whole_one():
    """A run that starts inside its segment (the segment began in an earlier prefill chunk)
    counts blocks and head tokens from the segment's start, not from the run's."""
    scores = torch.rand(40)
    # the same segment seen as two runs: tokens 0..19 in one chunk, 20..39 in the next
    first = select_kept(scores[:20], [[ReusedSegment(0, 20)]], [0.5], granularity="block", block_size=8)
    second = select_kept(scores[20:], [[ReusedSegment(0, 20, offset=20)]], [0.5], granularity="block", block_size=8)
    for part, start in ((first, 0), (second, 20)):
        blocks = {(start + int(i)) // 8 for i in part.nonzero().squeeze(1)}
        for b in blocks:  # every kept block is kept whole within the run: [b*8, b*8+8) ∩ run
            lo, hi = max(b * 8, start), min(b * 8 + 8, start + 20)
            assert part[lo - start:hi - start].all()
    heads = select_kept(torch.zeros(20), [[ReusedSegment(0, 20, offset=20)]], [0.0], head_tokens=4)
    assert not heads.any()  # the segment's head tokens were in the earlier chunk


def test_rules():
    with pytest.raises(ValueError, match="unknown selection rule"):
        rule_named("best")
    assert fixed_scores("oracle", torch.ones(3)).score(None).tolist() == [1.0, 1.0, 1.0]


def test_attention_kv_ranks_tokens_no_fresh_token_follows_by_deviation():
    """Under chunked prefill a chunk can end in reused text: those tokens receive no mass in this
    forward (no fresh query comes after them) and are weighted as the average seen token."""
    from sglang_tokendance.core.selection import CheckState

    def state(mass):
        k = torch.zeros(4, 1, 2)
        dev = torch.tensor([1.0, 4.0, 9.0, 16.0]).sqrt().view(4, 1, 1).expand(4, 1, 2) / 2 ** 0.5
        return CheckState([k, k], [k, k], [k, k + dev], [k, k], attention_received=torch.tensor(mass))

    rule = rule_named("attention-kv")
    seen = rule.score(state([4.0, 1.0, 0.0, 0.0]))  # tokens 2, 3: nothing after them in this chunk
    dev = torch.tensor([1.0, 4.0, 9.0, 16.0]) / 7.5
    torch.testing.assert_close(seen, dev * torch.tensor([2.0, 1.0, 1.5, 1.5]))
    assert seen.argsort(descending=True).tolist() == [3, 2, 1, 0]  # 0 mass would never recompute 2, 3
    torch.testing.assert_close(rule.score(state([0.0] * 4)), dev)  # nothing seen: deviation alone
    torch.testing.assert_close(rule.score(state([1.0, 4.0, 9.0, 16.0])), dev * torch.tensor([1.0, 2.0, 3.0, 4.0]))


@torch.no_grad()
def test_screen_passes_a_share_and_only_those_can_be_kept():
    model = tiny("llama")
    ids = prompt()
    kv, row = reuse_row(model, ids, cached_segment(model, ids, prompt(2)[:7]))
    cached_k = kv.k.clone()
    n, screen = SEG[1] - SEG[0], dict(check_layer=3, screen_layer=1, screen_factor=2.0)
    rule = rule_named("cacheblend-kv")
    options = BlendOptions(recompute_ratio=0.25, **screen)  # the screen passes 0.5 of the reused tokens
    checked = probe(model, kv, ids, torch.arange(ids.numel()), [row], rule, options)
    assert checked.tracked.sum() == round(0.5 * n)
    assert checked.rows.numel() == ids.numel() - n + round(0.5 * n)  # fresh + passed tokens
    assert checked.state.cached_k[3].shape[0] == checked.state.cached_k[0].shape[0] == round(0.5 * n)
    kept = select(checked, rule, options)
    assert kept.sum() == round(0.25 * n) and not (kept & ~checked.tracked).any()
    _, stats = finish(model, kv, checked, kept, options)
    slots = torch.arange(*SEG)
    for layer in range(model.num_layers):  # sparse write-back: cached KV wherever not kept
        assert torch.equal(kv.k[layer, slots[~kept]], cached_k[layer, slots[~kept]])
    fresh, passed = ids.numel() - n, round(0.5 * n)
    after_check = model.num_layers - 4  # layers 0-1 on all, 2-3 on fresh + passed, then fresh + kept
    assert stats.token_layers == ids.numel() * 2 + (fresh + passed) * 2 + (fresh + round(0.25 * n)) * after_check
    unscreened = probe(model, kv, ids, torch.arange(ids.numel()), [row], rule,
                       BlendOptions(recompute_ratio=0.25, check_layer=2, screen_layer=2))  # not below c: no screen
    assert unscreened.tracked.all() and unscreened.rows.numel() == ids.numel()


@torch.no_grad()
def test_screen_with_everything_passing_is_still_a_full_prefill_at_ratio_one(model):
    ids = prompt()
    kv, row = reuse_row(model, ids, cached_segment(model, ids, prompt(2)[:7]))
    options = BlendOptions(recompute_ratio=1.0, check_layer=2, screen_layer=1)
    out, _ = logits(model, ids, kv, row, options, rule_named("attention-kv"))
    torch.testing.assert_close(out, hf_logits(model, ids), atol=1e-4, rtol=1e-4)
