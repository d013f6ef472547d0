"""Round grouping rules (core/collective.py): fast, no SGLang."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tokendance.core.collective import RoundGrouper, RoundTag

NS = ("extra", None)


def grouper(window_s: float = 1.0, min_shared: int = 0, lead: bool = False) -> RoundGrouper[str]:
    return RoundGrouper(window_s, min_shared, lead)


def test_round_is_held_until_its_last_member_arrives_then_released_whole():
    g = grouper()
    for i, name in enumerate("abc"):
        assert g.arrive(name, NS, RoundTag("r", 3), [], now=0.1 * i) is not None
        if name != "c":
            assert g.release_due(now=0.1 * i) == [] and g.is_held(name)
    [record] = g.release_due(now=0.2)
    assert not any(g.is_held(n) for n in "abc")
    assert (record.members, record.fallback) == (3, False)
    assert record.wait_s == 0.2 + 0.1  # a waited 0.2, b 0.1, c nothing
    g.admitted(["a", "b", "x", "c"])
    assert record.admitted == [3] and g.largest_admitted == 3
    assert g.stats()["tracked_requests"] == 0 and g.stats()["open_rounds"] == 0


def test_led_round_releases_its_leader_first_and_the_others_once_its_prefill_is_done():
    g = grouper(lead=True)
    for name, hashes in (("a", ["x"]), ("b", ["x", "y", "z"]), ("c", ["x", "y"])):
        g.arrive(name, NS, RoundTag("r", 3), hashes, now=0)
    [record] = g.release_due(now=1.0, led=lambda leader: False)
    assert record.led and g.leads("b") and not g.is_held("b")  # the most segments: b leads
    assert g.is_held("a") and g.is_held("c") and not g.leads("a")
    g.admitted(["b"])
    assert g.release_due(now=1.5, led=lambda leader: False) == [] and g.is_held("a")
    g.release_due(now=2.0, led=lambda leader: leader == "b")
    assert not g.is_held("a") and not g.is_held("c") and not g.leads("b")
    assert record.wait_s == 2 * 1.0 + 1.0 + 2 * 1.0  # all three waited 1 s for c, then a and c 1 s for b
    g.admitted(["a", "c"])
    assert record.admitted == [1, 2] and g.stats()["led_rounds"] == 1 and g.stats()["tracked_requests"] == 0


def test_led_round_goes_on_without_a_leader_that_left_before_its_prefill():
    g = grouper(lead=True)
    for name in "abc":
        g.arrive(name, NS, RoundTag("r", 3), ["x"], now=0)
    g.release_due(now=0, led=lambda leader: False)
    assert g.leads("a") and g.is_held("b")
    g.keep_only(["b", "c"])  # the leader was aborted while waiting
    assert not g.is_held("b") and not g.is_held("c")
    g.release_due(now=0.1, led=lambda leader: False)
    assert g.stats()["held_requests"] == 0 and not g.leading


def test_round_of_one_has_no_leader():
    g = grouper(lead=True)
    g.arrive("a", NS, RoundTag("r", 1), ["x"], now=0)
    [record] = g.release_due(now=0, led=lambda leader: False)
    assert not record.led and not g.leads("a") and not g.is_held("a")


def test_request_without_round_is_never_held():
    g = grouper(min_shared=2)
    assert g.arrive("plain", NS, None, [], now=0) is None
    assert g.arrive("few", NS, None, ["h1"], now=0) is None  # fewer segments than min_shared
    assert not g.is_held("plain") and not g.is_held("few")
    assert g.knows("plain") and g.release_due(now=0) == []


def test_missing_member_costs_only_the_window_and_a_straggler_passes():
    g = grouper(window_s=1.0)
    g.arrive("a", NS, RoundTag("r", 3), [], now=0)
    g.arrive("b", NS, RoundTag("r", 3), [], now=0.5)
    assert g.release_due(now=0.99) == []
    [record] = g.release_due(now=1.0)
    assert record.fallback and record.members == 2 and g.fallbacks == 1
    assert g.arrive("c", NS, RoundTag("r", 3), [], now=1.2) is None  # late: not held again
    assert g.arrive("d", NS, RoundTag("r", 3), [], now=1.3) is not None  # one more than expected


def test_rounds_are_separate_per_namespace_and_id():
    g = grouper()
    a = g.arrive("a", NS, RoundTag("r", 2), [], now=0)
    b = g.arrive("b", ("other", None), RoundTag("r", 2), [], now=0)
    c = g.arrive("c", NS, RoundTag("s", 2), [], now=0)
    assert len({id(a), id(b), id(c)}) == 3 and g.release_due(now=0) == []


def test_aborted_held_member_leaves_no_state_and_still_counts_as_arrived():
    g = grouper()
    g.arrive("a", NS, RoundTag("r", 2), [], now=0)
    g.keep_only([])  # a was aborted while held
    assert g.stats()["tracked_requests"] == 0 and g.stats()["open_rounds"] == 0
    g.arrive("a", NS, RoundTag("r", 2), [], now=0)
    g.arrive("b", NS, RoundTag("r", 2), [], now=0)
    g.keep_only(["b"])
    [record] = g.release_due(now=0)  # a arrived, so b does not wait for a third
    assert record.members == 2 and not g.is_held("b")


def test_inferred_round_groups_requests_sharing_segments_for_one_window():
    g = grouper(window_s=1.0, min_shared=2)
    first = g.arrive("a", NS, None, ["h1", "h2", "h3"], now=0)
    assert first is not None and first.inferred
    assert g.arrive("b", NS, None, ["h2", "h3", "h9"], now=0.1) is first
    other = g.arrive("c", NS, None, ["h1", "h7"], now=0.2)  # shares one: a round of its own
    assert other is not first
    assert g.arrive("d", ("other", None), None, ["h1", "h2"], now=0.2) not in (first, other)
    assert g.release_due(now=0.9) == []
    released = g.release_due(now=1.0)
    assert [r.members for r in released] == [2]
    assert g.arrive("e", NS, None, ["h1", "h2"], now=1.05) not in (first, None)  # a new round


def test_order_puts_released_members_together_and_same_segments_adjacent():
    g = grouper()
    for name, hashes in (("a", ["x"]), ("b", ["y"]), ("c", ["x"])):
        g.arrive(name, NS, RoundTag("r", 3), hashes, now=0)
    g.release_due(now=0)
    assert g.order(["p", "a", "q", "b", "r", "c"]) == ["p", "a", "c", "b", "q", "r"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["p", "r1", "r2", "r3"]), st.integers(1, 4),
                          st.sets(st.sampled_from("uvwxyz"), max_size=3), st.floats(0, 0.5)),
                min_size=1, max_size=30),
       st.integers(0, 2), st.booleans(), st.randoms(use_true_random=False))
def test_grouping_properties(arrivals, min_shared, lead, rng):
    """Untagged requests without enough segments are never held; every held request is
    released by its window; `order` is a permutation keeping released groups contiguous and
    everything else in place; admitting everything leaves no state."""
    g = grouper(window_s=1.0, min_shared=min_shared, lead=lead)
    now, queue = 0.0, []
    for i, (kind, size, hashes, gap) in enumerate(arrivals):
        now += gap
        item = f"{kind}-{i}"
        tag = None if kind == "p" else RoundTag(kind, size)
        group = g.arrive(item, NS, tag, sorted(hashes), now)
        if tag is None and len(hashes) < min_shared or min_shared == 0 and tag is None:
            assert group is None
        queue.append(item)
        g.release_due(now, led=lambda leader: rng.random() < 0.5)
        if rng.random() < 0.1:  # an abort
            queue.remove(rng.choice(queue))
            g.keep_only(queue)
        ordered = g.order(queue)
        assert sorted(ordered) == sorted(queue)
        others = [q for q in queue if not (q in g.group_of and g.group_of[q].released)]
        assert [q for q in ordered if q in others] == others
        for group in {id(x): x for x in g.group_of.values() if x.released}.values():
            at = [k for k, q in enumerate(ordered) if g.group_of.get(q) is group]
            assert at == list(range(at[0], at[0] + len(at)))
    g.release_due(now + 2.0)  # past every window
    assert not any(g.is_held(q) for q in queue)
    g.admitted(queue)
    stats = g.stats()
    assert stats["tracked_requests"] == 0 and stats["open_rounds"] == 0 and stats["held_requests"] == 0
    assert stats["rounds_formed"] == len(g.recent) or stats["rounds_formed"] > len(g.recent) == 64


def test_a_late_member_joins_the_others_behind_a_leader_still_prefilling():
    g = grouper(window_s=0.05, lead=True)
    for name in "ab":
        g.arrive(name, NS, RoundTag("r", 3), ["x"], now=0)
    [record] = g.release_due(now=0.05, led=lambda leader: False)  # the window expired: released short
    assert record.fallback and g.leads("a") and g.is_held("b")
    g.admitted(["a"])
    assert g.arrive("c", NS, RoundTag("r", 3), ["x"], now=1.0) is g.group_of["b"]  # long after the window
    assert g.is_held("c") and not g.leads("c") and record.members == 3
    g.release_due(now=2.0, led=lambda leader: leader == "a")
    assert not g.is_held("b") and not g.is_held("c")
    assert record.wait_s == pytest.approx(0.05 + 0.05 + (2.0 - 0.05) + (2.0 - 1.0))


def test_a_round_id_reused_for_the_next_round_opens_it_while_the_last_ones_leader_prefills():
    """A complete round takes no more members: the same id names the client's next round,
    which is held for its own members and led by its own leader."""
    g = grouper(window_s=0.05, lead=True)
    for name in "ab":
        g.arrive(name, NS, RoundTag("chat", 2), ["x"], now=0)
    [first] = g.release_due(now=0, led=lambda leader: False)
    g.admitted([g.group_of["a"].leader])
    nxt = g.arrive("c", NS, RoundTag("chat", 2), ["y"], now=0.01)  # round 2, while round 1's leader prefills
    assert nxt is not None and not nxt.released and first.members == 2
    g.arrive("d", NS, RoundTag("chat", 2), ["y"], now=0.02)
    [second] = g.release_due(now=0.02, led=lambda leader: False)
    assert (second.members, second.fallback, second.led) == (2, False, True) and g.group_of["c"] is g.group_of["d"]
