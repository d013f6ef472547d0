"""core/plan: a chunk's runs over cached Masters, and the reads that continue a found content
chunk into its missed neighbour (content-defined chunks cut shared text where its content
says, so its head shares a chunk with whatever preceded it)."""

from __future__ import annotations

from sglang_tokendance.core.plan import EXTENSION_MIN_TOKENS, common_run, plan_chunk
from sglang_tokendance.core.segments import SegmentSpan

# the author's prompt: chunks A = [1..6] (its own text, then the shared head 5 6), B = [7..12] (shared),
# C = [13 14 15 90 91] (the shared tail 13 14 15, then its own text)
AUTHOR = {"A": (1, 2, 3, 4, 5, 6), "B": (7, 8, 9, 10, 11, 12), "C": (13, 14, 15, 90, 91)}
ORDER = ("A", "B", "C")
# the reader: its own text 40 41 42 43, the shared 5 6 | 7..12 | 13 14 15, its own 60 61 62 63
READER = [40, 41, 42, 43, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 60, 61, 62, 63]
SPANS = [SegmentSpan(0, 6, "x"), SegmentSpan(6, 12, "B"), SegmentSpan(12, 19, "y")]


def lookup(span: SegmentSpan):
    return (span.hash, len(AUTHOR[span.hash])) if span.hash in AUTHOR else None


def neighbour(master: str, before: bool, length: dict | None = None):
    at = ORDER.index(master) + (-1 if before else 1)
    if not 0 <= at < len(ORDER):
        return None
    name = ORDER[at]
    return name, AUTHOR[name], (length or {}).get(name, len(AUTHOR[name]))


def runs_of(plan) -> list[tuple[int, int, int, str]]:
    return [(r.start, r.end, r.segment_offset, r.master) for r in plan.runs]


def test_a_found_chunk_extends_into_its_missed_neighbours_by_what_they_share():
    plan = plan_chunk(SPANS, lookup, 0, len(READER), len(READER), neighbour, READER)
    # the head 5 6 read from A's tail (offset 4), B whole, the tail 13 14 15 from C's head
    assert runs_of(plan) == [(4, 6, 4, "A"), (6, 12, 0, "B"), (12, 15, 0, "C")]
    assert plan.found == [1] and plan.missed == [0, 2]  # the spans' hits and misses are as before
    assert runs_of(plan_chunk(SPANS, lookup, 0, len(READER), len(READER))) == [(6, 12, 0, "B")]  # no extension


def test_extensions_stay_inside_the_chunk_the_last_token_and_the_masters_kv():
    assert runs_of(plan_chunk(SPANS, lookup, 5, 14, len(READER), neighbour, READER)) == [
        (6, 12, 0, "B"), (12, 14, 0, "C")]  # [4, 6) clipped to [5, 6): shorter than the minimum
    assert EXTENSION_MIN_TOKENS == 2
    short = plan_chunk(SPANS, lookup, 0, len(READER), len(READER),
                       lambda m, b: neighbour(m, b, {"C": 2}), READER)  # C holds the KV of 2 tokens only
    assert runs_of(short)[-1] == (12, 14, 0, "C")
    last = plan_chunk(SPANS, lookup, 0, 14, 14, neighbour, READER)  # the prompt's last token (13) is computed:
    assert runs_of(last) == [(4, 6, 4, "A"), (6, 12, 0, "B")]  # C's read would be [12, 13), below the minimum


def test_a_span_not_next_to_the_found_one_is_not_extended():
    apart = [SegmentSpan(0, 5, "x"), SegmentSpan(6, 12, "B"), SegmentSpan(13, 19, "y")]  # gaps around B
    assert runs_of(plan_chunk(apart, lookup, 0, len(READER), len(READER), neighbour, READER)) == [(6, 12, 0, "B")]


def test_a_missed_chunk_between_two_found_ones_keeps_its_reads_apart():
    author = {"P": (1, 2), "Q": (3, 4, 5, 6), "R": (7, 8)}
    order = ("P", "Q", "R")
    ids = [1, 2, 3, 4, 5, 6, 7, 8]  # the middle chunk equals Q but is missed (evicted, say)
    spans = [SegmentSpan(0, 2, "P"), SegmentSpan(2, 6, "z"), SegmentSpan(6, 8, "R")]

    def near(master, before):
        at = order.index(master) + (-1 if before else 1)
        return (order[at], author[order[at]], len(author[order[at]])) if 0 <= at < 3 else None

    plan = plan_chunk(spans, lambda s: (s.hash, 2) if s.hash in ("P", "R") else None, 0, 8, 9, near, ids)
    assert runs_of(plan) == [(0, 2, 0, "P"), (2, 6, 0, "Q"), (6, 8, 0, "R")]  # one read of Q, not two overlapping


def test_common_run_counts_shared_ends_and_starts():
    assert common_run([1, 2, 3], [9, 2, 3], at_end=True) == 2 and common_run([1, 2, 3], [1, 2], at_end=False) == 2
    assert common_run([], [1], at_end=True) == 0 and common_run([5], [6], at_end=False) == 0
