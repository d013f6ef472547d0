"""core/recurrence: a block met again at the same place after the same prefix is computed exactly."""

from __future__ import annotations

import hashlib
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tokendance.core.recurrence import Sighting, Sightings, prefix_digests
from sglang_tokendance.core.segments import SegmentSpan

NS = ("extra", None)
# notes [0, 10), block A [10, 30), label [30, 33), block B [33, 53), instruction [53, 60)
IDS = list(range(1000, 1060))
A, B = SegmentSpan(10, 30, "a"), SegmentSpan(33, 53, "b")


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 1 << 40), max_size=40), cuts=st.lists(st.integers(0, 40), max_size=6))
def test_prefix_digests_are_the_digests_of_each_prefix(ids, cuts):
    positions = sorted(min(c, len(ids)) for c in cuts)
    expected = [hashlib.blake2b(array("q", ids[:p]).tobytes(), digest_size=16).digest() for p in positions]
    assert prefix_digests(ids, positions) == expected


def test_nothing_sighted_reuses_every_block():
    assert Sightings().recurrence(NS, IDS, [A, B], prefix_len=10).exact_until == 10


def test_blocks_sighted_at_the_frontier_are_computed_up_to_the_first_new_one():
    sightings = Sightings()
    sightings.record_prompt(NS, IDS, [A])
    assert sightings.recurrence(NS, IDS, [A, B], prefix_len=10).exact_until == A.end  # B was never seen there
    sightings.record_prompt(NS, IDS, [B])
    assert sightings.recurrence(NS, IDS, [A, B], prefix_len=10).exact_until == B.end
    assert sightings.recurrence(NS, IDS, [A, B], prefix_len=40).exact_until == B.end  # the tree already holds A
    only_b = Sightings()
    only_b.record_prompt(NS, IDS, [B])
    only_b_at_10 = only_b.recurrence(NS, IDS, [A, B], prefix_len=10)
    assert only_b_at_10 == (10, ())  # A comes first: B follows approximate KV, and is reused


def test_the_blocks_held_exactly_that_were_read_approximately_there_before_are_seen():
    """`seen`: what the request holds exactly (its radix match, or computed by recurrence) that
    would otherwise be reused again -- the credit of its recompute budget."""
    sightings = Sightings()
    assert sightings.recurrence(NS, IDS, [A, B], prefix_len=10).seen == ()
    sightings.record_prompt(NS, IDS, [A])
    assert sightings.recurrence(NS, IDS, [A, B], prefix_len=10).seen == (A,)  # computed; B reused
    assert sightings.recurrence(NS, IDS, [A, B], prefix_len=30).seen == (A,)  # in the tree's prefix now
    unseen = SegmentSpan(33, 53, "c")  # in the prefix but never read approximately: always exact
    assert sightings.recurrence(NS, IDS, [A, unseen], prefix_len=53).seen == (A,)
    sightings.record_output(NS, IDS[:30], "answer")  # a generated block is exact where it was made
    continued = IDS[:30] + list(range(20))
    answer = SegmentSpan(30, 50, "answer")
    assert sightings.recurrence(NS, continued, [A, answer], prefix_len=10) == (len(continued), (A,))


def test_a_block_after_other_tokens_or_in_another_namespace_is_not_a_recurrence():
    sightings = Sightings()
    sightings.record_prompt(NS, IDS, [A])
    other_notes = [7] + IDS[1:]
    assert sightings.recurrence(NS, other_notes, [A], prefix_len=0).exact_until == 0
    assert sightings.recurrence(("other", None), IDS, [A], prefix_len=10).exact_until == 10
    moved = SegmentSpan(11, 31, "a")  # the same block one token later
    assert sightings.recurrence(NS, [0] + IDS, [moved], prefix_len=11).exact_until == 11


def test_a_prompt_continuing_a_generated_answer_is_computed_throughout():
    sightings = Sightings()
    prompt = IDS[:30]  # notes, block A
    sightings.record_prompt(NS, prompt, [A])
    sightings.record_output(NS, prompt, "answer")
    answer = SegmentSpan(30, 50, "answer")
    later = prompt + list(range(20)) + IDS[30:]
    spans = [A, answer, SegmentSpan(53, 73, "b")]
    assert sightings.recurrence(NS, later, spans, prefix_len=10).exact_until == len(later)
    # the next round: the answer is in the tree's prefix now, the conversation goes on exactly
    assert sightings.recurrence(NS, later, spans, prefix_len=53).exact_until == len(later)
    sightings.record_prompt(NS, prompt, [SegmentSpan(30, 50, "answer")])  # a prompt read it there too
    assert sightings.get((NS, prefix_digests(prompt, [30])[0], "answer")) is Sighting.OUTPUT


def test_least_recently_seen_sightings_are_forgotten_first():
    sightings = Sightings(capacity=2)
    sightings.record_prompt(NS, IDS, [A, B])
    sightings.recurrence(NS, IDS, [A], prefix_len=10)  # A seen again: B is now the oldest
    sightings.record_output(NS, IDS, "c")
    assert len(sightings) == 2
    assert sightings.recurrence(NS, IDS, [A, B], prefix_len=10).exact_until == A.end
    sightings.clear()
    assert len(sightings) == 0
    with pytest.raises(ValueError, match="capacity"):
        Sightings(capacity=0)
