"""The forest's scheduler-side pieces without a server: joint eviction under SGLang's
eviction policies, chunk planning, per-request state, output segment ids, the forward's
fallback."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from sglang_tokendance.core.segment_table import SegmentTable
from sglang_tokendance.core.segments import SegmentSpan
from sglang_tokendance.server_args import TokenDanceArgs
from sglang_tokendance.srt.prompt_interface import CARRIER_KEY, REUSE_INFO_KEY


class Allocator:
    """What the radix tree and the forest call on SGLang's allocator."""

    device = "cpu"
    page_size = 1
    size = 1024

    def __init__(self):
        self.freed: list[int] = []

    def free(self, slots: torch.Tensor) -> None:
        self.freed += slots.tolist()

    def free_segment(self, slots: torch.Tensor, start_pos: int = 0) -> None:
        self.free(slots)

    def available_size(self) -> int:
        return len(self.freed)


def make_forest(policy: str = "lru", **options):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sglang_tokendance.srt.forest import SegmentForest

    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=Allocator(),
                             page_size=1, eviction_policy=policy)
    return SegmentForest(params, None, reuse=False, **options)


def test_a_prompt_rest_longer_than_one_chunks_work_is_selected_chunk_by_chunk():
    """Before, a chunk planning ahead probed the whole rest of its prompt in one step, its
    scratch KV outside SGLang's pool: now only a rest whose probe costs at most one prefill
    chunk through every layer."""
    from sglang_tokendance.srt.batch_reuse import PROBE_FLOOR_TOKENS, probe_limit

    assert probe_limit(16384, 30, 8) == 16384 * 30 // 9 and probe_limit(None, 30, 8) is probe_limit(-1, 30, 8) is None
    assert probe_limit(64, 30, 8) == probe_limit(PROBE_FLOOR_TOKENS, 30, 8)  # small chunks: at least the floor's
    forest = make_forest(probe_limit=64)
    assert forest.batch._plans_ahead(SimpleNamespace(origin_input_ids=[0] * 100, prefix_len=36))
    assert not forest.batch._plans_ahead(SimpleNamespace(origin_input_ids=[0] * 100, prefix_len=35))
    unplanned = make_forest(args=TokenDanceArgs(planned_selection=False)).batch
    assert not unplanned._plans_ahead(SimpleNamespace(origin_input_ids=[0], prefix_len=0))
    assert make_forest().batch._plans_ahead(SimpleNamespace(origin_input_ids=[0] * 10 ** 6, prefix_len=0))


def add_leaf(forest, ids: list[int], first_slot: int, accessed: float, created: float):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    forest.insert(InsertParams(key=RadixKey(array("q", ids)),
                               value=torch.arange(first_slot, first_slot + len(ids))))
    leaf = next(n for n in forest.evictable_leaves if int(n.value[-1]) == first_slot + len(ids) - 1)
    leaf.last_access_time, leaf.creation_time = accessed, created
    return leaf


def add_segment(forest, key: str, first_slot: int, length: int, accessed: float, created: float):
    entry = forest.segments.insert(key, torch.arange(first_slot, first_slot + length), list(range(length)))
    entry.last_access_time, entry.creation_time = accessed, created
    return entry


def two_of_each(forest):
    """Leaf a (slots 0-3), segment s (10-12), leaf b (20-24), segment t (30-31): accessed in
    that order, created in the reverse order."""
    add_leaf(forest, [1, 2, 3, 4], 0, accessed=1.0, created=4.0)
    add_segment(forest, "s", 10, 3, accessed=2.0, created=3.0)
    add_leaf(forest, [9, 8, 7, 6, 5], 20, accessed=3.0, created=2.0)
    add_segment(forest, "t", 30, 2, accessed=4.0, created=1.0)


def test_eviction_interleaves_leaves_and_segments_in_lru_order():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    forest = make_forest("lru")
    two_of_each(forest)
    assert forest.evictable_size() == 14
    result = forest.evict(EvictParams(num_tokens=5))  # the two least recently used: a, then s
    assert result.num_tokens_evicted == 7
    assert sorted(forest.token_to_kv_pool_allocator.freed) == [0, 1, 2, 3, 10, 11, 12]
    assert list(forest.segments.entries) == ["t"] and forest.evictable_size() == 7
    assert forest.evicted_slots == {"tree": 4, "master": 3}  # /server_info's evicted_*_slots


def test_eviction_honours_the_radix_eviction_policy():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    forest = make_forest("fifo")  # oldest created first: t, then leaf b
    two_of_each(forest)
    assert forest.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 7
    assert sorted(forest.token_to_kv_pool_allocator.freed) == [20, 21, 22, 23, 24, 30, 31]
    assert list(forest.segments.entries) == ["s"]


def test_eviction_stops_when_nothing_evictable_is_left():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    forest = make_forest()
    two_of_each(forest)
    locked = add_leaf(forest, [40, 41], 40, accessed=0.0, created=0.0)
    forest.inc_lock_ref(locked)
    result = forest.evict(EvictParams(num_tokens=1000))
    assert result.num_tokens_evicted == 14  # everything but the locked leaf, then it returns
    assert 40 not in forest.token_to_kv_pool_allocator.freed and forest.evictable_size() == 0


def fake_req(spans: list[SegmentSpan], prompt_len: int, prefix_len: int = 0, **extra):
    payload = {"segments": [vars(s) for s in spans], **extra}
    import json

    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params={CARRIER_KEY: json.dumps(payload)}),
                           origin_input_ids=list(range(prompt_len)), extra_key=None, cache_salt=None,
                           customized_info=None, prefix_len=prefix_len)


def options_of(req):
    from sglang_tokendance.srt.request import RequestOptions

    return RequestOptions.carried_by(req.sampling_params.custom_params)


def with_options(req):
    return req, options_of(req)


def test_a_segment_split_over_chunks_is_reused_piecewise_and_counted_once():
    from sglang_tokendance.srt.reuse import NOT_REUSED, RequestReuse

    spans = [SegmentSpan(10, 50, "a"), SegmentSpan(60, 100, "b")]
    req = fake_req(spans, prompt_len=120)
    state = RequestReuse.of(req, options_of(req), can_reuse=True)
    table = SegmentTable()
    table.insert(state.key("a"), torch.arange(100, 140), list(range(10, 50)))
    assert state.first_reused == NOT_REUSED
    first = state.plan_chunk(table, 0, 32)  # chunk [0, 32): the head of "a"
    assert [(r.start, r.end, r.segment_offset) for r in first.runs] == [(10, 32, 0)]
    assert first.request_row(torch.arange(32)).reused[0] == (10, 32, 0, state.key("a"))
    assert first.hits == 1 and state.first_reused == 10
    second = state.plan_chunk(table, 32, 64)  # the rest of "a" (from its token 22), the head of "b"
    assert [(r.start, r.end, r.segment_offset) for r in second.runs] == [(32, 50, 22)]
    row = second.request_row(torch.arange(64))
    assert (row.prefix_len, row.num_tokens, row.reused[0]) == (32, 32, (0, 18, 22, state.key("a")))
    assert row.max_approximate is None
    assert (second.hits, second.misses) == (0, 1)  # "a" was counted in the first chunk; "b" misses
    third = state.plan_chunk(table, 64, 120)
    assert third.runs == [] and (third.hits, third.misses) == (0, 0)
    counts = state.counts
    assert (counts.segment_hits, counts.segment_misses) == (1, 1)
    assert counts.reused_tokens == 40 and counts.computed_tokens == 120 - 40
    state.record_recomputed(first, 5, 5)
    assert (counts.reused_tokens, counts.recomputed_tokens, counts.computed_tokens) == (35, 5, 85)
    assert counts.mirror_diff_tokens == 5  # own slots at reused positions: 40 positions per 5 own slots
    assert req.customized_info[REUSE_INFO_KEY] == [{**vars(counts), "mirror_compression": 40 / 5}]


def test_a_fidelity_budget_is_spent_over_a_requests_chunks():
    """Each chunk gets what the earlier chunks' approximate tokens (reused, not recomputed) left."""
    from sglang_tokendance.srt.reuse import RequestReuse

    spans = [SegmentSpan(10, 50, "a"), SegmentSpan(60, 100, "b")]
    req = fake_req(spans, prompt_len=120)
    state = RequestReuse.of(req, options_of(req), can_reuse=True)
    table = SegmentTable()
    for span in spans:
        table.insert(state.key(span.hash), torch.arange(span.start, span.end), list(range(span.start, span.end)))
    first = state.plan_chunk(table, 0, 50, max_approximate=30)
    assert first.reused_tokens == 40 and first.request_row(torch.arange(50)).max_approximate == 30
    state.record_recomputed(first, 12, 12)  # 28 stayed approximate
    second = state.plan_chunk(table, 50, 120, max_approximate=30)
    assert second.max_approximate == 2 and second.request_row(torch.arange(120)).max_approximate == 2
    state.record_recomputed(second, 38, 38)
    assert state.plan_chunk(table, 120, 120, max_approximate=30).max_approximate == 0  # spent: never negative


def test_blocks_recurring_at_the_exact_frontier_are_computed_and_counted():
    from sglang_tokendance.core.recurrence import Sightings
    from sglang_tokendance.srt.reuse import RequestReuse, namespace_of

    spans = [SegmentSpan(10, 30, "a"), SegmentSpan(35, 55, "b")]
    table = SegmentTable()
    sightings = Sightings()
    first = fake_req(spans, prompt_len=60)
    for span in spans:
        table.insert((namespace_of(first), span.hash), torch.arange(span.start, span.end),
                     list(range(span.start, span.end)))
    sightings.record_prompt(namespace_of(first), first.origin_input_ids, spans[:1])  # "a" read there before
    again = fake_req(spans, prompt_len=60, prefix_len=10)
    state = RequestReuse.of(again, options_of(again), can_reuse=True, sightings=sightings)
    plan = state.plan_chunk(table, 10, 60)
    assert [(r.start, r.end) for r in plan.runs] == [(35, 55)]  # "a" computed exactly, "b" reused
    assert state.counts.exact_recurring_tokens == 20 and state.counts.reused_tokens == 20
    assert state.unpublished_spans(published=35) == spans[1:]
    everywhere = RequestReuse.of(again, options_of(again), can_reuse=True)  # --no-tokendance-exact-recurrence
    assert [(r.start, r.end) for r in everywhere.plan_chunk(table, 10, 60).runs] == [(10, 30), (35, 55)]


def test_a_recurring_block_without_a_cached_master_is_not_counted_as_computed_exactly_for_recurring():
    """Before, every block before the exact frontier counted in `exact_recurring_tokens`, also
    one that no Master holds (the request would have computed it anyway)."""
    from sglang_tokendance.core.recurrence import Sightings
    from sglang_tokendance.srt.reuse import RequestReuse, namespace_of

    spans = [SegmentSpan(10, 30, "a"), SegmentSpan(35, 55, "b")]
    table, sightings = SegmentTable(), Sightings()
    first = fake_req(spans, prompt_len=60)
    table.insert((namespace_of(first), "b"), torch.arange(35, 55), list(range(35, 55)))  # "a" evicted since
    sightings.record_prompt(namespace_of(first), first.origin_input_ids, spans[:1])
    again = fake_req(spans, prompt_len=60, prefix_len=10)
    state = RequestReuse.of(again, options_of(again), can_reuse=True, sightings=sightings)
    plan = state.plan_chunk(table, 10, 60)
    assert [(r.start, r.end) for r in plan.runs] == [(35, 55)]
    assert state.counts.exact_recurring_tokens == 0 and state.counts.reused_tokens == 20


def test_admissions_look_at_segments_touches_nothing_and_the_plan_reads_each_once():
    """Before, admission's estimate (`would_read`) and the look at a prompt's later chunks went
    through the counting lookup: a refused admission bumped its Masters' hits and recency
    (SGLang's eviction order) and counted a mismatching entry as refused each time."""
    from sglang_tokendance.srt.reuse import RequestReuse, namespace_of

    spans = [SegmentSpan(0, 20, "a"), SegmentSpan(20, 40, "b")]
    table = SegmentTable()
    req = fake_req(spans, prompt_len=60)
    a = table.insert((namespace_of(req), "a"), torch.arange(20), list(range(20)))
    table.insert((namespace_of(req), "b"), torch.arange(20), [7] * 20)  # another text under b's key
    touched = a.last_access_time
    state = RequestReuse.of(req, options_of(req), can_reuse=True)
    for _ in range(3):
        assert state.would_read(table, 0, 60).reused_tokens == 20
        assert state.runs_in(table, 0, 60).reused_tokens == 20
    assert (a.hit_count, a.last_access_time, table.refused) == (0, touched, 0)
    state.plan_chunk(table, 0, 30)
    state.plan_chunk(table, 30, 60)  # "b" spans both chunks: read once
    assert (a.hit_count, table.refused) == (1, 1) and a.last_access_time > touched


def test_blocks_recurrence_makes_exact_stay_in_the_budget_of_the_blocks_still_reused():
    """Before, a block computed exactly left the pool of the request's recompute share: the
    blocks it still reused kept fewer recomputed tokens than with exact recurrence off."""
    from sglang_tokendance.core.blend_types import BlendOptions
    from sglang_tokendance.core.recurrence import Sightings
    from sglang_tokendance.core.selection import kept_share
    from sglang_tokendance.srt.reuse import RequestReuse, namespace_of

    spans = [SegmentSpan(10, 50, "brief"), SegmentSpan(55, 95, "msg"), SegmentSpan(100, 120, "msg2")]
    table, sightings, blend = SegmentTable(), Sightings(), BlendOptions(recompute_ratio=0.3)
    first = fake_req(spans, prompt_len=130)
    for span in spans:
        table.insert((namespace_of(first), span.hash), torch.arange(span.start, span.end),
                     list(range(span.start, span.end)))
    sightings.record_prompt(namespace_of(first), first.origin_input_ids, spans[:1])  # the briefing read there
    again = fake_req(spans, prompt_len=130, prefix_len=10)
    state = RequestReuse.of(again, options_of(again), can_reuse=True, sightings=sightings, blend=blend)
    plan = state.plan_chunk(table, 10, 100)
    assert [(r.start, r.end) for r in plan.runs] == [(55, 95)] and state.counts.exact_recurring_tokens == 40
    kept = round(kept_share(0.3, 40, plan.request_row(torch.arange(100)).max_approximate) * 40)
    assert kept == round(0.3 * (40 + 40)) == 24  # the briefing's 40 tokens stay in the pool (alone: 12)
    later = state.plan_chunk(table, 100, 130)  # credited once: the next chunk has the share alone
    assert later.reused_tokens == 20 and later.request_row(torch.arange(130)).max_approximate is None
    gone = RequestReuse.of(again, options_of(again), can_reuse=True, sightings=sightings, blend=blend)
    table.remove(table.entries[(namespace_of(first), "brief")])  # no Master: it would be computed anyway
    assert gone.plan_chunk(table, 10, 130).max_approximate is None
    off = RequestReuse.of(again, options_of(again), can_reuse=True, blend=blend)  # recurrence off: all reused
    assert off.plan_chunk(table, 10, 130).max_approximate is None


def test_a_corrupted_entry_is_refused_and_the_span_computed():
    from sglang_tokendance.srt.reuse import RequestReuse

    req = fake_req([SegmentSpan(0, 20, "a"), SegmentSpan(20, 40, "b")], prompt_len=50)
    state = RequestReuse.of(req, options_of(req), can_reuse=True)
    table = SegmentTable()
    table.insert(state.key("a"), torch.arange(20), list(range(20)))
    table.insert(state.key("b"), torch.arange(20, 40), list(range(20, 40))).ids = tuple(range(21, 41))
    plan = state.plan_chunk(table, 0, 50)
    assert [(r.start, r.end) for r in plan.runs] == [(0, 20)] and (plan.hits, plan.misses) == (1, 1)
    assert table.refused == 1 and state.counts.computed_tokens == 30


def test_the_last_prompt_token_and_a_short_entry_are_never_reused():
    from sglang_tokendance.srt.reuse import RequestReuse

    req = fake_req([SegmentSpan(0, 20, "a"), SegmentSpan(30, 50, "out")], prompt_len=50)
    state = RequestReuse.of(req, options_of(req), can_reuse=True)
    table = SegmentTable()
    table.insert(state.key("a"), torch.arange(20), list(range(20)))
    table.insert(state.key("out"), torch.arange(100, 119), list(range(30, 50)))  # an output: last token lacks KV
    plan = state.plan_chunk(table, 0, 50)
    assert [(r.start, r.end) for r in plan.runs] == [(0, 20), (30, 49)]


def test_requests_without_segments_or_reuse_keep_sglangs_path():
    from sglang_tokendance.srt.reuse import RequestReuse, namespace_of

    assert RequestReuse.of(*with_options(fake_req([], 10)), can_reuse=True) is None
    registering = RequestReuse.of(*with_options(fake_req([], 10, register_output=True)), can_reuse=True)
    assert registering.options.register_output and not registering.can_reuse
    req = fake_req([SegmentSpan(0, 20, "a")], 30)
    state = RequestReuse.of(req, options_of(req), can_reuse=False)
    table = SegmentTable()
    table.insert(state.key("a"), torch.arange(20), list(range(20)))
    assert state.plan_chunk(table, 0, 30).runs == [] and req.customized_info is None
    assert namespace_of(SimpleNamespace(extra_key="lora-x", cache_salt="t")) != namespace_of(
        SimpleNamespace(extra_key=None, cache_salt="t"))


@pytest.mark.parametrize("field,value", [("return_hidden_states", True), ("input_embeds", [[0.0]]),
                                         ("return_logprob", True)])
def test_features_the_blended_prefill_does_not_reproduce_take_sglangs_forward(field, value):
    from sglang_tokendance.srt.reuse import may_reuse

    req = SimpleNamespace(return_logprob=False, logprob_start_len=-1, origin_input_ids=list(range(30)),
                          return_hidden_states=False, input_embeds=None, multimodal_inputs=None)
    assert may_reuse(req)
    setattr(req, field, value)
    if field == "return_logprob":
        req.logprob_start_len = 0  # input-token logprobs from the first token
    assert not may_reuse(req)


def test_output_segment_ids_drop_the_stop_token_and_refuse_stop_strings():
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN

    from sglang_tokendance.srt.output_registration import output_kv_tokens, output_segment_ids

    def req(reason, n=20):
        return SimpleNamespace(output_ids=list(range(100, 100 + n)), finished_reason=reason)

    assert output_segment_ids(req(FINISH_LENGTH(20)), 16) == list(range(100, 120))
    assert output_segment_ids(req(FINISH_MATCHED_TOKEN(119)), 16) == list(range(100, 119))
    assert output_segment_ids(req(FINISH_MATCHED_STR("\n")), 16) is None
    assert output_segment_ids(req(FINISH_ABORT("gone")), 16) is None
    assert output_segment_ids(req(FINISH_LENGTH(10), n=10), 16) is None  # shorter than a segment
    assert output_kv_tokens(req(FINISH_LENGTH(20)), 20) == 19  # the last token was never fed back
    assert output_kv_tokens(req(FINISH_MATCHED_TOKEN(119)), 19) == 19


def test_batches_with_embeddings_or_captured_hidden_states_take_sglangs_forward():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from sglang_tokendance.srt.forward_hook import blendable

    batch = SimpleNamespace(input_embeds=None, capture_hidden_mode=CaptureHiddenMode.NULL)
    assert blendable(batch)
    assert not blendable(SimpleNamespace(input_embeds=torch.zeros(3, 4), capture_hidden_mode=None))
    assert not blendable(SimpleNamespace(input_embeds=None, capture_hidden_mode=CaptureHiddenMode.FULL))


def test_segment_copies_store_k_unrotated_and_restore_it_at_the_readers_positions():
    """Caching a segment (dense storage) stores K un-rotated and restoring it writes K rotated
    at the reader's positions, as SGLang's pool holds it; V is copied as it is."""
    from sglang_tokendance.core.rope import RopeSpec, rotate
    from sglang_tokendance.srt.kv_copy import PoolKeys, copy_kv

    spec = RopeSpec(head_dim=8, rotary_dim=8, base=10000.0)
    keys = PoolKeys(spec)
    raw = torch.randn(4, 2, 8)
    written, read = torch.arange(7, 11), torch.arange(2, 6)  # the segment's positions for author and reader
    k_buffers, v_buffers = [torch.zeros(16, 2, 8)], [torch.zeros(16, 2, 8)]
    k_buffers[0][:4] = rotate(raw, written, spec)
    v_buffers[0][:4] = torch.randn(4, 2, 8)
    pool = SimpleNamespace(start_layer=0, layer_num=1, get_key_buffer=k_buffers.__getitem__,
                           get_value_buffer=v_buffers.__getitem__)
    segment, reader = torch.arange(4, 8), torch.arange(8, 12)
    copy_kv(pool, torch.arange(4), segment, written, keys.unrotated)
    copy_kv(pool, segment, reader, read, keys.pooled)
    torch.testing.assert_close(k_buffers[0][segment], raw, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_buffers[0][reader], rotate(raw, read, spec), atol=1e-5, rtol=1e-5)
    assert torch.equal(v_buffers[0][reader], v_buffers[0][:4])


def mirror_forest(size: int = 64, rows: int = 4, diff_threshold: float = 0.0):
    """A forest under mirror storage over SGLang's RadixCache, our RefCountedAllocator and a
    req_to_token table (no model: zero-copy bookkeeping never touches the KV, the diff
    threshold reads it: one layer, one head of 8 dims), recomputing a quarter of each row's
    reused tokens (3 of 12: its own slots there)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sglang_tokendance.core.rope import RopeSpec
    from sglang_tokendance.srt.forest import SegmentForest
    from sglang_tokendance.srt.kv_copy import PoolKeys
    from sglang_tokendance.srt.pool import RefCountedAllocator

    buffer, values = torch.zeros(size + 1, 1, 8), torch.zeros(size + 1, 1, 8)
    kvcache = SimpleNamespace(start_layer=0, layer_num=1, get_key_buffer=lambda layer: buffer,
                              get_value_buffer=lambda layer: values)
    allocator = RefCountedAllocator(size, dtype=torch.float32, device="cpu", kvcache=kvcache, need_sort=False)
    table = SimpleNamespace(req_to_token=torch.zeros(rows, 128, dtype=torch.int32))
    params = CacheInitParams(disable=False, req_to_token_pool=table, token_to_kv_pool_allocator=allocator,
                             page_size=1, eviction_policy="lru")
    args = TokenDanceArgs(storage="mirror", recompute_ratio=0.25, check_layer=1, screen_layer=0,
                          diff_threshold=diff_threshold)
    return SegmentForest(params, PoolKeys(RopeSpec(head_dim=8, rotary_dim=8, base=1e4)), args, reuse=True)


class Req(SimpleNamespace):
    __hash__, __eq__ = object.__hash__, object.__eq__  # SGLang's Req: keyed by identity


def reading_req(forest, pool_index: int, spans: list[SegmentSpan], prompt_len: int):
    """A request SGLang admitted, reading segment ids 100.. in each span, its row not
    allocated yet (`allocation`)."""
    req = Req(**vars(fake_req(spans, prompt_len)))
    for span in spans:
        req.origin_input_ids[span.start:span.end] = range(100, 100 + span.end - span.start)
    req.__dict__.update(rid=f"req-{pool_index}", prefix_len=0, extend_end=prompt_len, last_node=None, lora_id=None,
                        return_logprob=False, logprob_start_len=-1, return_hidden_states=False, input_embeds=None,
                        multimodal_inputs=None, kv=SimpleNamespace(req_pool_idx=pool_index))
    return req


def allocated_req(forest, pool_index: int, spans: list[SegmentSpan], prompt_len: int):
    """A request SGLang just allocated: its row holds fresh own slots for the whole prompt."""
    req = reading_req(forest, pool_index, spans, prompt_len)
    forest.req_to_token_pool.req_to_token[pool_index, :prompt_len] = forest.token_to_kv_pool_allocator.alloc(
        prompt_len).to(torch.int32)
    return req


def allocation(forest, reqs: list):
    """SGLang's allocation of the batch `reqs` (alloc_for_extend at page size 1: one
    alloc_token_slots call, through our AROUND hook, evicting as it must; the rows written
    from its slots), for BatchReuse.restore; returns the slots (out_cache_loc)."""
    from sglang.srt.mem_cache.allocation import alloc_token_slots

    from sglang_tokendance.srt.forest import allocate_after_reads

    def allocate() -> torch.Tensor:
        out = allocate_after_reads(alloc_token_slots, forest, sum(r.extend_end - r.prefix_len for r in reqs))
        at = 0
        for r in reqs:
            n = r.extend_end - r.prefix_len
            forest.req_to_token_pool.req_to_token[r.kv.req_pool_idx, r.prefix_len:r.extend_end] = out[at:at + n]
            at += n
        return out

    return allocate


def restore(forest, reqs: list) -> torch.Tensor:
    """Plan, allocate and read in the batch `reqs` as SGLang's prepare_for_extend would."""
    return forest.batch.restore(SimpleNamespace(reqs=reqs), allocation(forest, reqs))


def release(forest, req, prompt_len: int) -> None:
    """What SGLang does when a request ends: free its row, then tell the cache."""
    row = forest.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :prompt_len]
    forest.token_to_kv_pool_allocator.free(row.to(torch.int64))
    forest.on_release(req, checkpointed=False)


def test_zero_copy_rows_read_one_master_at_different_offsets_and_free_only_their_own_slots():
    """Two rows read one Master at different offsets: the batch's allocation gives each its
    fresh slots and one own slot per token it can keep (3 of its 12 reused), not one per
    prompt token; the reused positions read the Master; after the forward a kept token's own
    slot joins its row, the others are freed; the pool's accounting holds throughout."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    forest = mirror_forest()
    allocator, rows = forest.token_to_kv_pool_allocator, forest.req_to_token_pool.req_to_token
    author = allocator.alloc(12)
    forest.storage.cache(((None, None), "a"), list(range(100, 112)), author.to(torch.int32), 0, 12)
    allocator.free(author)  # the author's row ends: the Master alone holds its slots (zero copy: no new slots)
    assert allocator.available_size() == 64 - 12 and forest.evictable_size() == 12
    master = forest.segments.entries[((None, None), "a")].slots
    first = reading_req(forest, 1, [SegmentSpan(2, 14, "a")], 20)
    second = reading_req(forest, 2, [SegmentSpan(5, 17, "a")], 20)
    out = restore(forest, [first, second])
    assert allocator.available_size() == 64 - 12 - 2 * (8 + 3)  # 22 slots for 40 prompt tokens
    assert torch.equal(rows[1, 2:14].long(), master) and torch.equal(rows[2, 5:17].long(), master)  # shared
    assert not out[2:14].any() and not out[20 + 5:20 + 17].any()  # SGLang's forward writes no Master slot
    plans = {i: forest.batch.planned[i] for i in (1, 2)}
    own = {i: plans[i].own.clone() for i in (1, 2)}
    assert own[1].numel() == own[2].numel() == 3
    assert not torch.isin(torch.cat([own[1], own[2]]), rows[1:3, :20].long()).any()  # aside, in no row yet
    assert forest.evictable_size() == 0 and forest.stats()["row_references"] == 24
    busy_check = lambda: (allocator.available_size() + forest.evictable_size() + forest.protected_size()  # noqa: E731
                          + 2 * 20)  # SGLang's, counting both rows' 20 positions as theirs
    assert busy_check() == 64
    kept = torch.zeros(12, dtype=torch.bool)
    kept[[0, 5]] = True  # the blended prefill recomputed two of the first reader's tokens
    free_before = allocator.available_size()
    # the second reads the Master everywhere (ratio 0)
    forest.batch.settle([forest.batch.planned.pop(1), forest.batch.planned.pop(2)],
                        torch.cat([kept, torch.zeros(12, dtype=torch.bool)]), None)
    assert rows[1, 2] == own[1][0] and rows[1, 7] == own[1][1] and torch.equal(rows[1, 3:7].long(), master[1:5])
    assert allocator.available_size() == free_before + 1 + 3  # every own slot no kept token took
    assert busy_check() == 64
    stats = forest.stats()
    assert (stats["row_references"], stats["pinned_segments"], stats["master_tokens"]) == (22, 1, 12)
    assert forest.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 0  # read by live rows
    assert list(forest.segments.entries) and forest.evictable_size() == 0
    release(forest, first, 20)
    assert forest.evictable_size() == 0  # still read by the second row
    release(forest, second, 20)
    assert forest.evictable_size() == 12 and forest.stats()["pinned_segments"] == 0
    assert forest.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 12
    assert allocator.available_size() == 64 and not allocator.refs.refs.any() and not allocator.refs.reads.any()


@pytest.mark.parametrize("after_a_cache_reset", [False, True])
def test_a_forward_that_computes_everything_gives_every_reused_position_its_own_slot_back(after_a_cache_reset):
    """A planned row whose forward cannot blend (never expected: BatchReuse.restore plans no such
    batch), or whose plan outlived a forward that never ran: every reused position gets a slot
    of its own (its kept-token slots, then new ones, frames recorded) and drops its Master; the
    forward's out_cache_loc writes there, never to a Master or the padding slot, and the
    attention metadata built for the row's reads is built again. The frames it records are
    those every reader of frames sees, after SGLang's cache reset (`flush_cache` clears the
    allocator) as before."""
    forest = mirror_forest()
    allocator, rows = forest.token_to_kv_pool_allocator, forest.req_to_token_pool.req_to_token
    if after_a_cache_reset:
        allocator.clear()
    author = allocator.alloc(12)
    forest.storage.cache(((None, None), "a"), list(range(100, 112)), author.to(torch.int32), 0, 12)
    master = forest.segments.entries[((None, None), "a")].slots
    req = reading_req(forest, 1, [SegmentSpan(0, 12, "a")], 16)
    out = restore(forest, [req])
    metadata = []  # the rows each (re)build of the attention metadata saw
    backend = SimpleNamespace(init_forward_metadata=lambda fb: metadata.append(rows[1, :16].long().clone()))
    batch = SimpleNamespace(req_pool_indices_cpu=torch.tensor([1]), extend_prefix_lens_cpu=[0],
                            extend_seq_lens_cpu=[16], out_cache_loc=out.clone())
    assert forest.batch.take_plans(batch, False, backend) is None and not forest.batch.planned  # SGLang's forward runs
    assert torch.equal(rows[1, :16].long(), batch.out_cache_loc.long()) and forest.stats()["row_references"] == 0
    assert batch.out_cache_loc.all() and not torch.isin(batch.out_cache_loc, master).any()
    assert torch.equal(allocator.frames.frame[batch.out_cache_loc[:12]], torch.arange(12, dtype=torch.int32))
    assert not forest.reads.shifts(batch.out_cache_loc[:12].long(), torch.arange(12)).any()  # read unshifted
    assert len(metadata) == 1 and torch.equal(metadata[0], batch.out_cache_loc.long())  # built on the own slots
    assert req.customized_info[REUSE_INFO_KEY][0]["recomputed_tokens"] == 12
    stale = reading_req(forest, 2, [SegmentSpan(0, 12, "a")], 16)
    restore(forest, [stale])  # planned, and its forward never ran
    forest.batch.restore(SimpleNamespace(reqs=[]), lambda: None)
    assert torch.isin(rows[2, :16].long(), master).sum() == 0 and forest.stats()["pinned_segments"] == 0
    release(forest, req, 16)
    release(forest, stale, 16)
    allocator.free(author)
    assert forest.evictable_size() == 12 == 64 - allocator.available_size()


def test_a_batch_short_of_slots_gives_up_first_the_reads_its_admission_did_not_credit():
    """A reader SGLang admitted on what it takes (credited its reused tokens, its Master pinned
    by another live reader, so its reads free nothing if given up) shares a batch with a row
    that begins reading an evictable Master only as the batch is built (a continuing chunk:
    SGLang charged its whole extend, counting that Master evictable). Pinned, that Master no
    longer counts, and the batch is short by the late row's own slots. The late row gives its
    reads up (its Master evictable again) and the batch fits; giving every row's up would ask
    for the credited reader's whole extend, which is not there (SGLang's allocation would
    raise Out of memory)."""
    forest = mirror_forest()
    allocator, rows = forest.token_to_kv_pool_allocator, forest.req_to_token_pool.req_to_token
    for key in ("a", "b"):
        author = allocator.alloc(12)
        forest.storage.cache(((None, None), key), list(range(100, 112)), author.to(torch.int32), 0, 12)
        allocator.free(author)  # the Masters alone hold their slots
    other = reading_req(forest, 0, [SegmentSpan(0, 12, "a")], 20)
    restore(forest, [other])
    forest.batch.settle([forest.batch.planned.pop(0)], None, None)  # it reads "a" (pinned) for as long as it lives
    assert (allocator.available_size(), forest.evictable_size()) == (32, 12)  # "b" alone evictable
    reader = reading_req(forest, 1, [SegmentSpan(0, 12, "a")], 20)
    assert forest.batch.admit(reader) == 12 - 3  # charged 8 fresh + 3 own
    late = reading_req(forest, 2, [SegmentSpan(0, 12, "b")], 32)  # charged its 32
    restore(forest, [reader, late])
    master_a = forest.segments.entries[((None, None), "a")].slots
    assert torch.equal(rows[1, :12].long(), master_a) and forest.batch.planned[1].own.numel() == 3  # still reads
    assert forest.requests[late].counts.computed_tokens == 32  # the late row computes its chunk, as SGLang charged
    assert ((None, None), "b") not in forest.segments.entries and allocator.available_size() == 44 - 43  # evicted
    assert rows[2, :32].unique().numel() == 32
    forest.batch.settle([forest.batch.planned.pop(1)], None, None)
    assert forest.stats()["pinned_segments"] == 1 and forest.evictable_size() == 0


def test_a_plan_met_by_another_chunk_is_refused():
    """The forward must compute the chunk its plan was made for: reused positions outside the
    batch's chunk could get their KV from no forward."""
    forest = mirror_forest()
    author = forest.token_to_kv_pool_allocator.alloc(12)
    forest.storage.cache(((None, None), "a"), list(range(100, 112)), author.to(torch.int32), 0, 12)
    out = restore(forest, [reading_req(forest, 1, [SegmentSpan(0, 12, "a")], 16)])
    batch = SimpleNamespace(req_pool_indices_cpu=torch.tensor([1]), extend_prefix_lens_cpu=[0],
                            extend_seq_lens_cpu=[10], out_cache_loc=out[:10].clone())
    with pytest.raises(RuntimeError, match=r"planned the chunk \[0, \+16\) of a request whose forward computes "
                                           r"\[0, \+10\)"):
        forest.batch.take_plans(batch, True, None)


def leaf_held_by_a_master(forest, key: str, accessed: float):
    """Ten new slots held by a tree leaf (ids 200..209) and by the Master of segment `key`."""
    slots = forest.token_to_kv_pool_allocator.alloc(10)
    leaf = add_leaf(forest, list(range(200, 210)), int(slots[0]), accessed=accessed, created=accessed)
    assert torch.equal(leaf.value, slots)
    forest.storage.cache(((None, None), key), list(range(100, 110)), slots.to(torch.int32), 0, 10)
    return slots, leaf


def test_a_master_shared_with_the_tree_is_counted_once_and_outlives_the_trees_leaf():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    forest = mirror_forest()
    allocator = forest.token_to_kv_pool_allocator
    slots, tree = leaf_held_by_a_master(forest, "t", accessed=1.0)
    assert forest.evictable_size() == 10 and 64 - allocator.available_size() == 10  # one slot, one count
    reader = reading_req(forest, 1, [SegmentSpan(0, 10, "t")], 12)
    restore(forest, [reader])
    forest.batch.settle([forest.batch.planned.pop(1)], None, None)
    assert forest.evictable_size() == 0  # the tree's leaf is evictable, but its slots stay with the reader
    assert allocator.available_size() + forest.evictable_size() + forest.protected_size() + 12 == 64
    assert forest.evict(EvictParams(num_tokens=5)).num_tokens_evicted == 0
    release(forest, reader, 12)
    assert forest.evict(EvictParams(num_tokens=5)).num_tokens_evicted >= 5
    assert 64 - allocator.available_size() == forest.evictable_size()
    forest.reset()
    assert not forest.segments.entries


def test_allocating_a_mirror_batch_never_evicts_the_masters_it_reads():
    """A round admitted on a short pool (mirror storage): the batch holds the Masters it reads
    before SGLang's allocation evicts, so that eviction takes everything else first and never
    them; where even that leaves too little, the rows give their reads up and SGLang allocates
    every token a slot as it would (evicting the Master, now read by none)."""
    forest = mirror_forest()
    allocator = forest.token_to_kv_pool_allocator
    for name, accessed in (("read", 1.0), ("other", 2.0)):  # the one the batch reads is used least recently
        author = allocator.alloc(12)
        forest.storage.cache(((None, None), name), list(range(100, 112)), author.to(torch.int32), 0, 12)
        allocator.free(author)
        forest.segments.entries[((None, None), name)].last_access_time = accessed
    add_leaf(forest, [7, 8, 9, 10], int(allocator.alloc(4)[0]), accessed=0.5, created=0.5)
    filler = allocator.alloc(31)  # a live request's: 5 slots are free
    req = reading_req(forest, 1, [SegmentSpan(2, 14, "read")], 20)
    restore(forest, [req])  # 8 fresh + 3 own slots: the leaf and "other" go
    assert list(forest.segments.entries) == [((None, None), "read")] and forest.batch.planned[1].runs
    forest.batch.settle([forest.batch.planned.pop(1)], None, None)
    release(forest, req, 20)

    allocator.free(filler)
    filler = allocator.alloc(64 - 12 - 10)  # 10 free, the Master alone evictable: 11 do not fit beside it
    req = reading_req(forest, 1, [SegmentSpan(2, 14, "read")], 20)
    restore(forest, [req])
    assert not forest.segments.entries and 1 not in forest.batch.planned  # nothing else left: computed
    counts = req.customized_info[REUSE_INFO_KEY][0]
    assert (counts["reused_tokens"], counts["computed_tokens"]) == (0, 20)
    assert forest.stats()["row_references"] == 0 and allocator.available_size() == 2
    release(forest, req, 20)


def test_allocating_a_dense_batch_evicts_the_segments_it_will_read_last():
    """Dense storage (copies): SGLang's allocation may evict (inside the AROUND hook on
    prepare_for_extend); the segment the batch reads goes only after every other evictable
    item, and still goes when nothing else is left (SGLang's budget holds)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_tokendance.srt.forest import restore_after_allocation

    forest = dense_forest(64)
    allocator = forest.token_to_kv_pool_allocator
    author = allocator.alloc(12)
    for name, accessed in (("read", 1.0), ("other", 2.0)):  # the one the batch reads is used least recently
        forest.storage.cache(((None, None), name), list(range(100, 112)), author.to(torch.int32), 0, 12)
        forest.segments.entries[((None, None), name)].last_access_time = accessed
    allocator.free(author)
    add_leaf(forest, [7, 8, 9, 10], int(allocator.alloc(4)[0]), accessed=0.5, created=0.5)
    evicted = []

    def prepare_for_extend(batch, wanted: int):
        evicted.append(forest.evict(EvictParams(num_tokens=wanted)).num_tokens_evicted)
        return "allocated"

    req = allocated_req(forest, 1, [SegmentSpan(2, 14, "read")], 20)
    batch = SimpleNamespace(reqs=[req], tree_cache=forest)
    assert restore_after_allocation(prepare_for_extend, batch, 12) == "allocated"
    assert evicted == [4 + 12] and list(forest.segments.entries) == [((None, None), "read")]  # leaf, then other
    assert [run.master.key for run in forest.batch.planned[1].runs] == [((None, None), "read")]
    assert not forest.batch.wanted
    forest.batch.settle([forest.batch.planned.pop(1)], None, None)
    release(forest, req, 20)

    req = allocated_req(forest, 1, [SegmentSpan(2, 14, "read")], 20)
    restore_after_allocation(prepare_for_extend, SimpleNamespace(reqs=[req], tree_cache=forest), 1000)
    assert evicted[-1] == 12 and not forest.segments.entries and 1 not in forest.batch.planned  # nothing else left
    counts = req.customized_info[REUSE_INFO_KEY][0]
    assert (counts["reused_tokens"], counts["computed_tokens"]) == (0, 20)  # the run it planned is computed
    release(forest, req, 20)


def test_a_kept_row_is_matched_by_its_agent_alone_and_counted_once_per_slot():
    """keep_for_agent: a finished row stays in the tree for its agent (no copy: one more
    reference on each slot, the tree's counted once); only that agent's requests match it;
    a row whose tokens the agent keeps with other slots is not kept; a lock keeps it from
    eviction, and evicting it frees exactly the slots nobody else holds."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    forest = mirror_forest()
    allocator = forest.token_to_kv_pool_allocator

    def finished(agent: str | None, tokens: list[int], pool_index: int):
        req = allocated_req(forest, pool_index, [], len(tokens))
        req.sampling_params.custom_params = fake_req([], 0, **({"agent": agent} if agent else {})).sampling_params \
            .custom_params
        req.__dict__.update(full_untruncated_fill_ids=array("q", tokens), priority=None)
        return req

    def matched(agent: str | None, tokens: list[int]) -> int:
        asking = finished(agent, [], 3)
        return forest.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=asking)).device_prefix_len

    tokens = list(range(500, 520))
    add_leaf(forest, tokens[:6], int(allocator.alloc(6)[0]), accessed=1.0, created=1.0)  # the exact prefix, public
    row = finished("a", tokens, 1)
    table = forest.req_to_token_pool.req_to_token
    allocator.free(table[1, :6].to(torch.int64))  # as SGLang's checkpoint: the row now reads the tree's slots
    table[1, :6] = forest.evictable_leaves.copy().pop().value.to(torch.int32)
    forest.kept.keep_for_agent(row, "a", 20)
    allocator.free(table[1, 6:20].to(torch.int64))  # SGLang frees the row past its tree prefix
    forest.on_release(row, checkpointed=True)  # its own slots 6..19 stay with the kept path
    stats = forest.stats()
    assert stats["agent_rows_kept"] == 1 and stats["tree_tokens"] == 20 == 64 - stats["free_tokens"]
    assert forest.evictable_size() == 20  # slots 0..5 are held by two nodes, counted once
    assert (matched("a", tokens + [1]), matched("b", tokens + [1]), matched(None, tokens + [1])) == (20, 6, 6)

    other = finished("a", tokens[:10] + [7, 7], 2)  # the same first tokens, computed again into other slots
    forest.kept.keep_for_agent(other, "a", 12)
    release(forest, other, 12)
    assert forest.stats()["agent_rows_kept"] == 1 and 64 - allocator.available_size() == 20

    asking = finished("a", [], 3)
    node = forest.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens + [1])), req=asking)).last_device_node
    forest.inc_lock_ref(node)
    assert forest.evictable_size() == 0 and forest.protected_size() == 20
    assert forest.evict(EvictParams(num_tokens=20)).num_tokens_evicted == 0
    forest.dec_lock_ref(node)
    assert forest.evict(EvictParams(num_tokens=20)).num_tokens_evicted == 20
    assert allocator.available_size() == 64 and not allocator.refs.tree.any() and not allocator.refs.refs.any()


def test_an_unnamed_row_is_kept_for_any_request_with_segments_that_repeats_it():
    """Without agent names (the default client), a finished row holding approximate KV is
    kept under the unnamed namespace: a request with segments that repeats its tokens takes it
    (it then reads what the row read, instead of computing its blocks again); a request
    without segments never reads approximate KV (it is served as stock SGLang would), nor does
    an agent's (its own namespace), nor any under --no-tokendance-keep-rows."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    forest = mirror_forest()
    allocator, table = forest.token_to_kv_pool_allocator, forest.req_to_token_pool.req_to_token
    tokens = list(range(500, 520))

    def matched(spans: list[SegmentSpan], agent: str | None = None, **options) -> int:
        asking = reading_req(forest, 3, spans, 0)
        if agent is not None or options:
            extra = {"agent": agent} if agent is not None else {}
            asking.sampling_params.custom_params = fake_req(spans, 0, **extra, **options).sampling_params.custom_params
        return forest.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens + [1])), req=asking)
                                   ).device_prefix_len

    row = allocated_req(forest, 1, [], 20)
    row.__dict__.update(full_untruncated_fill_ids=array("q", tokens), priority=None)
    assert forest.kept.keeps(options_of(row))
    forest.kept.keep_for_agent(row, None, 20)
    release(forest, row, 20)
    block = [SegmentSpan(8, 18, "b")]
    assert (matched(block), matched([]), matched(block, agent="a")) == (20, 0, 0)
    frames = allocator.frames
    frames.record(table[1, :20].to(torch.int64), torch.arange(20))  # written where it stands: exact KV
    frames.record(table[1, 8:18].to(torch.int64), torch.arange(30, 40))  # a Master read at a shift: approximate
    assert forest.kept.approximate_positions(forest.match_prefix(MatchPrefixParams(
        key=RadixKey(array("q", tokens)), req=reading_req(forest, 3, block, 0))).last_device_node) == 10
    assert (matched(block, max_approximate_tokens=10), matched(block, max_approximate_tokens=9)) == (20, 0)
    assert forest.stats()["agent_rows_kept"] == 1 and 64 - allocator.available_size() == 20
    forest.kept.keeps_unnamed = False  # --no-tokendance-keep-rows
    assert not forest.kept.keeps(options_of(row)) and matched(block) == 0


def dense_forest(size: int = 16):
    """A forest under dense storage over SGLang's own page-size-1 allocator and a tiny KV pool."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sglang_tokendance.core.rope import RopeSpec
    from sglang_tokendance.srt.forest import SegmentForest
    from sglang_tokendance.srt.kv_copy import PoolKeys

    k_buffers, v_buffers = [torch.zeros(size + 1, 1, 8)], [torch.zeros(size + 1, 1, 8)]
    kvcache = SimpleNamespace(start_layer=0, layer_num=1, get_key_buffer=k_buffers.__getitem__,
                              get_value_buffer=v_buffers.__getitem__)
    allocator = TokenToKVPoolAllocator(size, dtype=torch.float32, device="cpu", kvcache=kvcache, need_sort=False)
    table = SimpleNamespace(req_to_token=torch.zeros(2, 64, dtype=torch.int32))
    params = CacheInitParams(disable=False, req_to_token_pool=table, token_to_kv_pool_allocator=allocator,
                             page_size=1, eviction_policy="lru")
    return SegmentForest(params, PoolKeys(RopeSpec(head_dim=8, rotary_dim=8, base=1e4)),
                         TokenDanceArgs(recompute_ratio=0.0), reuse=True)


def test_a_segment_cached_while_sglang_defers_frees_evicts_and_is_kept():
    """SGLang's result processing (where checkpoints cache segments) defers every free to the end
    of a free group: a dense segment copy that must evict still gets the slots it evicted."""
    forest = dense_forest(16)
    allocator = forest.token_to_kv_pool_allocator
    add_leaf(forest, list(range(300, 310)), int(allocator.alloc(10)[0]), accessed=0.0, created=0.0)
    author = allocator.alloc(6)  # a finishing request's row: the pool is full
    assert allocator.available_size() == 0
    allocator.free_group_begin()
    forest.storage.cache(((None, None), "s"), list(range(100, 106)), author.to(torch.int32), 0, 6)
    allocator.free_group_end()
    assert ((None, None), "s") in forest.segments and forest.evictable_size() == 6  # the leaf went for it


def test_eviction_inside_a_free_group_counts_what_it_frees_under_mirror_storage():
    """Mirror storage counts the slots an eviction frees by their last reference, so inside a
    free group (nothing reaches the free list yet) it stops once enough is evicted."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    forest = mirror_forest()
    allocator = forest.token_to_kv_pool_allocator
    for i in range(3):
        slots = allocator.alloc(12)
        add_leaf(forest, list(range(100 * i, 100 * i + 12)), int(slots[0]), accessed=float(i), created=0.0)
    allocator.free_group_begin()
    assert forest.evict(EvictParams(num_tokens=5)).num_tokens_evicted == 12
    assert forest.evictable_size() == 24
    allocator.free_group_end()
    assert allocator.available_size() == 64 - 24


def test_a_round_leaders_blocks_supersede_a_master_that_live_rows_still_read():
    """The leader (srt/policy) reads nothing and caches its blocks with `replace`: a new reader
    gets the leader's slots, a live reader keeps the superseded Master's until it ends (held,
    out of the table), the pool's accounting holds throughout and nothing leaks."""
    forest = mirror_forest()
    allocator, rows = forest.token_to_kv_pool_allocator, forest.req_to_token_pool.req_to_token
    key = ((None, None), "a")
    author = allocator.alloc(12)
    forest.storage.cache(key, list(range(100, 112)), author.to(torch.int32), 0, 12)
    allocator.free(author)
    old = forest.segments.entries[key]
    reader = reading_req(forest, 1, [SegmentSpan(2, 14, "a")], 20)
    restore(forest, [reader])
    forest.batch.settle([forest.batch.planned.pop(1)], None, None)  # the reader reads all 12 of the Master's slots
    forest.leads = lambda req: True
    leader = reading_req(forest, 2, [SegmentSpan(4, 16, "a")], 20)
    restore(forest, [leader])
    state = forest.requests[leader]
    assert state.leads and not forest.batch.planned and state.counts.reused_tokens == 0  # computed exactly
    forest.insert_segments(leader, state, up_to=20)
    new = forest.segments.entries[key]
    assert new is not old and torch.equal(new.slots, rows[2, 4:16].long()) and state.counts.round_master_tokens == 12
    assert forest.storage.retired == [old] and forest.segments.stats(1)["segments_superseded"] == 1
    assert torch.equal(rows[1, 2:14].long(), old.slots)  # the live reader is untouched
    # SGLang's busy check: the reader's 20 positions, the leader's outside its block (its checkpoint
    # puts the block in the tree, not counted as its own)
    assert allocator.available_size() + forest.evictable_size() + forest.protected_size() + 20 + 8 == 64
    forest.leads = lambda req: False
    follower = reading_req(forest, 3, [SegmentSpan(0, 12, "a")], 14)
    restore(forest, [follower])
    assert torch.equal(rows[3, :12].long(), new.slots)  # later readers read the leader's KV
    forest.batch.settle([forest.batch.planned.pop(3)], None, None)
    release(forest, reader, 20)
    assert forest.storage.retired == [] and not allocator.refs.refs[old.slots].any()  # freed with its last reader
    release(forest, follower, 14)
    release(forest, leader, 20)
    assert 64 - allocator.available_size() == forest.evictable_size() == 12  # the new Master alone


def test_dense_storage_replaces_a_superseded_master_copy_at_once():
    forest = dense_forest(16)
    allocator = forest.token_to_kv_pool_allocator
    key = ((None, None), "s")
    author = allocator.alloc(6)
    forest.storage.cache(key, list(range(100, 106)), author.to(torch.int32), 0, 6)
    old = forest.segments.entries[key].slots.clone()
    assert forest.storage.cache(key, list(range(100, 106)), author.to(torch.int32), 0, 6) == 0  # a duplicate
    assert forest.storage.cache(key, list(range(100, 106)), author.to(torch.int32), 0, 6, replace=True) == 6
    assert not torch.equal(forest.segments.entries[key].slots, old) and forest.segments.tokens == 6
    assert allocator.available_size() == 16 - 6 - 6 and forest.storage.retired == []
    stats = forest.segments.stats(1)
    assert (stats["segment_duplicates"], stats["segments_superseded"], stats["segments_evicted"]) == (1, 1, 0)


def test_eviction_under_mirror_storage_takes_what_frees_slots_before_what_frees_none():
    """A tree leaf whose slots a Master also holds frees nothing alone: the least recently used
    item that frees slots goes first, and the shared pair is kept; when only the pair is left,
    both go and their slots come free."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    forest = mirror_forest()
    allocator = forest.token_to_kv_pool_allocator
    _, shared_leaf = leaf_held_by_a_master(forest, "m", accessed=0.0)
    forest.segments.entries[((None, None), "m")].last_access_time = 0.5
    alone = allocator.alloc(12)
    add_leaf(forest, list(range(300, 312)), int(alone[0]), accessed=1.0, created=1.0)  # used most recently
    assert forest.evictable_size() == 22
    assert forest.evict(EvictParams(num_tokens=5)).num_tokens_evicted == 12
    assert shared_leaf in forest.evictable_leaves and ((None, None), "m") in forest.segments
    assert allocator.available_size() == 64 - 10
    assert forest.evict(EvictParams(num_tokens=5)).num_tokens_evicted == 10
    assert not forest.segments.entries and allocator.available_size() == 64


def test_recomputed_kv_within_the_diff_threshold_of_its_master_is_not_kept():
    """Mirror storage with --tokendance-diff-threshold: of two recomputed tokens, the one whose
    K (read at the row's positions: the Master's is rotated at its author's) and V match the
    Master's within the threshold reads the Master after all and frees its own slot; the other
    keeps its own KV. Counted as recomputed, within_threshold and Mirror diff tokens."""
    from sglang_tokendance.core.rope import rotate

    forest = mirror_forest(diff_threshold=0.05)
    allocator, rows = forest.token_to_kv_pool_allocator, forest.req_to_token_pool.req_to_token
    keys, values = allocator.get_kvcache().get_key_buffer(0), allocator.get_kvcache().get_value_buffer(0)
    spec = forest.keys.rope
    plain_k, plain_v = torch.randn(12, 1, 8), torch.randn(12, 1, 8)
    author = allocator.alloc(12)
    keys[author], values[author] = rotate(plain_k, torch.arange(12), spec), plain_v
    allocator.frames.record(author, torch.arange(12))
    forest.storage.cache(((None, None), "a"), list(range(100, 112)), author.to(torch.int32), 0, 12)
    allocator.free(author)
    reader = reading_req(forest, 1, [SegmentSpan(2, 14, "a")], 20)  # reads the Master at shift +2
    restore(forest, [reader])
    plan = forest.batch.planned.pop(1)
    own = plan.own.clone()
    # what the blended prefill wrote for its two kept tokens (its first two own slots): nearly the
    # Master's KV, and far from it
    keys[own[0]], values[own[0]] = rotate(plain_k[0:1], torch.tensor([2]), spec)[0] * 1.01, plain_v[0] * 0.99
    keys[own[1]], values[own[1]] = rotate(plain_k[5:6] + 1.0, torch.tensor([7]), spec)[0], plain_v[5]
    kept = torch.zeros(12, dtype=torch.bool)
    kept[[0, 5]] = True
    free_before = allocator.available_size()
    forest.batch.settle([plan], kept, None)
    master = forest.segments.entries[((None, None), "a")].slots
    assert rows[1, 2] == master[0] and rows[1, 7] == own[1]
    assert allocator.available_size() == free_before + 2  # every own slot but token 5's
    counts = forest.requests[reader].counts
    assert (counts.recomputed_tokens, counts.within_threshold_tokens, counts.mirror_diff_tokens) == (2, 1, 1)
    release(forest, reader, 20)
    assert forest.stats()["row_references"] == 0 and forest.stats()["pinned_segments"] == 0


def test_slots_freed_after_a_mirror_forward_reopen_sglangs_admission_once():
    """SGLang stops admitting after a request did not fit until one leaves its running batch;
    a zero-copy row's forward frees slots without one leaving, so the next admission pass is
    let through (once: a pass with nothing freed since leaves SGLang's verdict alone)."""
    from sglang_tokendance.srt.runtime import SchedulerRuntime

    runtime = SchedulerRuntime(TokenDanceArgs(storage="mirror"))
    forest = runtime.forest = mirror_forest()
    allocator = forest.token_to_kv_pool_allocator
    author = allocator.alloc(12)
    forest.storage.cache(((None, None), "a"), list(range(100, 112)), author.to(torch.int32), 0, 12)
    req = reading_req(forest, 1, [SegmentSpan(0, 12, "a")], 16)
    restore(forest, [req])
    running = SimpleNamespace(batch_is_full=True)
    runtime.reopen_admission(None, running)
    assert running.batch_is_full  # nothing freed yet: the row holds its own slots until its forward ran
    kept = torch.zeros(12, dtype=torch.bool)
    kept[:2] = True
    forest.batch.settle([forest.batch.planned.pop(1)], kept, None)
    runtime.reopen_admission(None, running)
    assert not running.batch_is_full  # an own slot no kept token took came free
    running.batch_is_full = True  # SGLang's pass found the pool still short
    runtime.reopen_admission(None, running)
    assert running.batch_is_full
    release(forest, req, 16)
    allocator.free(author)


def test_a_reader_admitted_is_charged_the_slots_it_will_allocate_and_holds_its_masters():
    """Mirror storage: once SGLang's admission commits a reader (the AROUND hook on
    PrefillAdder.add_one_req), its chunk is planned, its Masters are held (no longer evictable)
    and the reservation of the reused tokens it will not keep goes back to the pass's budget;
    the batch then takes that plan (counted once) and allocates exactly what stayed reserved.
    A request the blended prefill cannot serve joins no batch with such a reader, and a reader
    after one keeps SGLang's full charge."""
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    from sglang_tokendance.srt.runtime import SchedulerRuntime

    runtime = SchedulerRuntime(TokenDanceArgs(storage="mirror"))
    forest = runtime.forest = mirror_forest()
    allocator = forest.token_to_kv_pool_allocator
    author = allocator.alloc(12)
    forest.storage.cache(((None, None), "a"), list(range(100, 112)), author.to(torch.int32), 0, 12)
    allocator.free(author)  # the Master alone holds its 12 slots: evictable

    def pass_():
        budget = PrefillBudget(allocator, forest)
        adder = SimpleNamespace(can_run_list=[], memory_budget=budget,
                                budget_state=lambda: AddReqResult.CONTINUE if budget.has_capacity()
                                else AddReqResult.NO_TOKEN)
        return adder, budget

    def add_one_req(adder, req, has_chunked_req, truncation_align_size):  # SGLang's commit, in short
        req.extend_end = len(req.origin_input_ids)
        adder.can_run_list.append(req)
        adder.memory_budget.reserve(req.extend_end - req.prefix_len, 8)
        return adder.budget_state()

    adder, budget = pass_()
    before = budget.remaining_total
    reader = reading_req(forest, 1, [SegmentSpan(2, 14, "a")], 20)
    asked = []

    def check(adder, req, *, extend_input_len, total_tokens, **unused):  # SGLang's admission check
        asked.append(total_tokens)
        return total_tokens < budget.remaining_total, None

    runtime.check_admission(check, adder, reader, extend_input_len=20, total_tokens=20 + 8)
    # asked what it will take: 12 reused tokens but the 3 it can keep spared, the Master's 12
    # evictable slots held (a look: nothing planned, counted or held yet)
    assert asked == [20 + 8 - (12 - 3) + 12] and reader not in forest.requests and forest.evictable_size() == 12
    assert runtime.admit(add_one_req, adder, reader, False, None) == AddReqResult.CONTINUE
    # charged its 8 fresh + 3 own slots (and SGLang's page and decode headroom), the Master no longer evictable
    assert before - budget.remaining_total == (8 + 3 + 1 + 8) + 12
    assert forest.evictable_size() == 0 and forest.batch.reads_admitted(reader)
    wants_hidden = reading_req(forest, 2, [], 10)
    wants_hidden.return_hidden_states = True
    assert runtime.admit(add_one_req, adder, wants_hidden, False, None) == AddReqResult.OTHER
    assert adder.can_run_list == [reader]
    free_before = allocator.available_size()
    restore(forest, [reader])
    assert free_before - allocator.available_size() == 8 + 3  # what stayed reserved
    counts = forest.requests[reader].counts
    assert (counts.reused_tokens, counts.segment_hits) == (12, 1)  # planned once
    forest.batch.settle([forest.batch.planned.pop(1)], None, None)

    adder, budget = pass_()  # a request that cannot blend first: the reader after it pays SGLang's charge
    assert runtime.admit(add_one_req, adder, wants_hidden, False, None) == AddReqResult.CONTINUE
    second = reading_req(forest, 3, [SegmentSpan(0, 12, "a")], 16)
    runtime.check_admission(check, adder, second, extend_input_len=16, total_tokens=16 + 8)
    assert asked[-1] == 16 + 8  # SGLang's check: it would not be credited either
    before = budget.remaining_total
    runtime.admit(add_one_req, adder, second, False, None)
    assert before - budget.remaining_total == 16 + 1 + 8 and not forest.batch.reads_admitted(second)
    restore(forest, [wants_hidden, second])
    master = forest.segments.entries[((None, None), "a")].slots
    rows = forest.req_to_token_pool.req_to_token
    assert not forest.batch.planned and not torch.isin(rows[3, :16].long(), master).any()  # SGLang's forward
    for req, n in ((reader, 20), (wants_hidden, 10), (second, 16)):
        release(forest, req, n)
    assert forest.stats()["row_references"] == 0 and forest.evictable_size() == 12 == 64 - allocator.available_size()


def test_next_use_eviction_takes_what_no_round_reads_soon_before_sglangs_order():
    """Under next-use eviction the reads of released requests order eviction before the policy:
    a leaf whose rounds stopped coming goes first, then the farthest next read; a request
    outside any round is a round of its own, the path of the prefix it matched read up to the
    root (not the nodes it wrote after it).
    Under recency (the default) the LRU order stays."""
    import time

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_tokendance.srt.eviction import record_reads

    def leaves(args):
        forest = make_forest("lru", args=args)
        return forest, [add_leaf(forest, [i + 1] * 4, 10 * i, accessed=float(i), created=0.0) for i in range(3)]

    forest, (gone, slow, fast) = leaves(TokenDanceArgs(eviction="next-use"))
    now = time.monotonic()
    for rid, leaf, at in (("g0", gone, -30), ("g1", gone, -29), ("s0", slow, -12), ("s1", slow, -2),
                          ("f0", fast, -6), ("f1", fast, -3)):
        forest.next_use.used([id(leaf)], ("request", rid), now + at)
    assert forest.next_use.uses[id(slow)].period == 10 and forest.next_use.uses[id(fast)].period == 3
    forest.evict(EvictParams(num_tokens=8))  # gone (dead: unread 29 s, period 1), then slow (next read in 8 s)
    assert sorted(forest.token_to_kv_pool_allocator.freed) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert id(gone) not in forest.next_use.uses and id(slow) not in forest.next_use.uses
    reader = SimpleNamespace(matched=fast, reading=[], round=None)  # a request whose prefix matched `fast`
    record_reads(forest, SimpleNamespace(last_node=None, rid="f2"), reader)
    assert forest.next_use.uses[id(fast)].round == ("request", "f2")
    record_reads(forest, SimpleNamespace(last_node=fast, rid="f3"), None)  # no reuse state: no read recorded
    assert forest.next_use.uses[id(fast)].round == ("request", "f2")
    forest.reset()
    assert not forest.next_use.uses

    recency, (first, *_) = leaves(TokenDanceArgs())
    assert recency.next_use is None
    recency.evict(EvictParams(num_tokens=1))
    assert recency.token_to_kv_pool_allocator.freed == [0, 1, 2, 3]  # the least recently used


def hinted_release(forest, node, payload: dict, state=None):
    """SGLang releasing a finished request whose options carry `payload` and whose path ends
    at `node`."""
    import json

    req = Req(sampling_params=SimpleNamespace(custom_params={CARRIER_KEY: json.dumps(payload)}),
              finished=lambda: True, last_node=node, rid="r")
    if state is not None:
        forest.requests[req] = state
    forest.on_release(req, checkpointed=True)


def test_a_released_requests_own_tail_is_evicted_first_until_something_reads_it_again():
    """Before, the newest leaf went last (LRU); a request released with `release` sends the
    tail only it holds first, not the prefix another path branches from."""
    import time

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    forest = make_forest()
    old = add_leaf(forest, [1, 2, 3, 4], 0, accessed=1.0, created=0.0)
    add_leaf(forest, [5, 6, 7, 8, 9], 10, accessed=2.0, created=0.0)  # shares nothing
    mine = add_leaf(forest, [5, 6, 7, 8, 1, 1], 16, accessed=3.0, created=0.0)  # [5, 6, 7, 8] split off
    assert mine.value.tolist() == [20, 21]
    hinted_release(forest, mine, {"segments": [], "release": True})
    assert forest.hints.stats()["hint_marks"] == 1  # [1, 1] alone: its parent [5, 6, 7, 8] has another child
    forest.evict(EvictParams(num_tokens=1))
    assert sorted(forest.token_to_kv_pool_allocator.freed) == [20, 21]
    forest.evict(EvictParams(num_tokens=1))
    assert sorted(forest.token_to_kv_pool_allocator.freed) == [0, 1, 2, 3, 20, 21]  # then LRU: `old`
    assert old not in forest.evictable_leaves

    again = make_forest()
    add_leaf(again, [1, 2, 3, 4], 0, accessed=1.0, created=0.0)
    read = add_leaf(again, [9, 9], 30, accessed=2.0, created=0.0)
    hinted_release(again, read, {"segments": [], "release": True})
    time.sleep(0.01)
    again.match_prefix(MatchPrefixParams_of(RadixKey(array("q", [9, 9]))))  # another request reads it
    again.evict(EvictParams(num_tokens=1))
    assert again.token_to_kv_pool_allocator.freed == [0, 1, 2, 3]  # LRU again


def MatchPrefixParams_of(key):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return MatchPrefixParams(key=key)


def test_a_retained_path_and_its_masters_go_after_everything_else_until_the_deadline():
    import time

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    forest = make_forest()
    oldest = add_leaf(forest, [1, 2, 3, 4], 0, accessed=1.0, created=0.0)
    add_segment(forest, "s", 10, 3, accessed=2.0, created=0.0)
    add_leaf(forest, [9, 8, 7, 6, 5], 20, accessed=3.0, created=0.0)
    master = add_segment(forest, "t", 30, 2, accessed=0.5, created=0.0)
    state = SimpleNamespace(options=SimpleNamespace(spans=[SimpleNamespace(hash="t")]), key=lambda h: h,
                            kept=None, reading=[], read_slots={})
    hinted_release(forest, oldest, {"segments": [], "retain_seconds": 0.3}, state)
    assert master.readers == 0 and "t" in forest.segments
    forest.evict(EvictParams(num_tokens=8))  # s, then the newer leaf: the retained ones stay
    assert sorted(forest.token_to_kv_pool_allocator.freed) == [10, 11, 12, 20, 21, 22, 23, 24]
    assert "t" in forest.segments and oldest in forest.evictable_leaves
    time.sleep(0.35)  # the deadline passed: LRU again (t, accessed at 0.5, before the leaf)
    forest.evict(EvictParams(num_tokens=1))
    assert "t" not in forest.segments and oldest in forest.evictable_leaves


def test_a_pin_holds_its_path_protected_within_the_budget_until_its_deadline():
    """A pin locks the path with SGLang's lock (protected, never evicted) until its deadline;
    one past the pin budget is a retain instead, counted."""
    import time

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    forest = make_forest()
    forest.hints.max_pinned_tokens = 6
    pinned = add_leaf(forest, [1, 2, 3, 4], 0, accessed=1.0, created=0.0)
    big = add_leaf(forest, [9, 8, 7, 6, 5], 20, accessed=2.0, created=0.0)
    hinted_release(forest, pinned, {"segments": [], "pin_seconds": 0.3})
    assert (forest.protected_size(), forest.evictable_size()) == (4, 5)
    hinted_release(forest, big, {"segments": [], "pin_seconds": 0.3})  # 4 + 5 > 6: a retain
    stats = forest.hints.stats()
    assert (stats["hint_pins"], stats["hint_pinned_tokens"], stats["hint_pins_clipped"]) == (1, 4, 1)
    forest.evict(EvictParams(num_tokens=100))  # everything evictable: the retained leaf too
    assert sorted(forest.token_to_kv_pool_allocator.freed) == [20, 21, 22, 23, 24] and pinned.lock_ref == 1
    time.sleep(0.35)
    assert (forest.protected_size(), forest.evictable_size()) == (0, 4) and pinned.lock_ref == 0
    forest.evict(EvictParams(num_tokens=1))
    assert 0 in forest.token_to_kv_pool_allocator.freed and forest.hints.stats()["hint_pins"] == 0


def test_a_simulations_end_releases_what_its_requests_left_and_only_its_own_masters():
    """Before, an ended simulation's KV went where recency put it (last: it was read most
    recently); now the request that ends it sends everything its requests alone left first."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    forest = make_forest()
    other = add_leaf(forest, [1, 2, 3, 4], 0, accessed=1.0, created=0.0)  # another simulation's, older
    mine = [add_leaf(forest, [7, i, 7], 10 * i + 20, accessed=2.0 + i, created=0.0) for i in range(2)]
    add_segment(forest, "own", 60, 2, accessed=0.5, created=0.0)
    add_segment(forest, "shared", 70, 2, accessed=0.4, created=0.0)

    def state(*keys):
        return SimpleNamespace(options=SimpleNamespace(spans=[SimpleNamespace(hash=k) for k in keys]),
                               key=lambda h: h, kept=None, reading=[], read_slots={})

    hinted_release(forest, other, {"segments": [], "simulation": "s2"}, state("shared"))
    hinted_release(forest, mine[0], {"segments": [], "simulation": "s1"}, state("own", "shared"))
    assert forest.hints.stats()["hint_marks"] == 0  # booked, not released yet
    hinted_release(forest, mine[1], {"segments": [], "simulation": "s1", "end_simulation": True}, state())
    stats = forest.hints.stats()
    assert (stats["simulations_booked"], stats["simulations_ended"]) == (1, 1)
    # [7] is the two leaves' shared parent: only each leaf's own [i, 7] is released, and "own"
    forest.evict(EvictParams(num_tokens=6))
    assert sorted(forest.token_to_kv_pool_allocator.freed) == [21, 22, 31, 32, 60, 61]
    forest.evict(EvictParams(num_tokens=1))  # then recency: the shared Master, the oldest
    assert sorted(forest.token_to_kv_pool_allocator.freed)[-2:] == [70, 71] and other in forest.evictable_leaves
    forest.reset()
    assert forest.hints.stats()["simulations_booked"] == 0
