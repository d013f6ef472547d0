"""core/next_use: reads by rounds give each item a period; eviction ranks what no round will
read soon first, and on rounds that come back in turn it keeps what LRU loses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tokendance.core.next_use import NextUse


def test_reads_by_one_round_count_once_and_nothing_is_predicted_before_a_period():
    book = NextUse()
    book.used(["a", "b"], "r0", 0.0)
    book.used(["a"], "r0", 0.5)  # another request of the same round
    assert book.uses["a"].period is None and book.typical is None
    assert book.rank("a", 0.0, 10.0) == book.rank("b", 0.0, 10.0) == book.rank("never", 0.0, 10.0) == (1, 0.0)


def test_the_farthest_next_read_goes_first_and_an_overdue_item_before_it():
    book = NextUse()
    book.used(["fast", "slow", "gone"], "r0", 0.0)
    book.used(["fast", "gone"], "r1", 2.0)  # fast and gone: a period of 2
    book.used(["slow"], "r2", 10.0)  # slow: 10
    book.used(["fast"], "r3", 10.0)
    assert book.uses["fast"].period == pytest.approx(2 + 0.5 * (8 - 2))  # smoothed: 5
    ranks = {item: book.rank(item, 0.0, 11.0) for item in ("fast", "slow", "gone")}
    assert ranks["gone"] == (0, 0.0)  # unread for 9 s, three periods of 2
    assert ranks["slow"] < ranks["fast"]  # next reads at 20 and 15: slow goes first
    assert book.rank("written", 10.5, 11.0) == (1, 0.0)  # never read by a round: before every read item
    assert book.rank("written", 0.0, 30.0) == (0, 0.0)  # ... and dead after three typical periods (7 s)
    assert book.periodic() == 3


def test_the_book_is_bounded_forgets_and_clears():
    book = NextUse(limit=3)
    book.used(["a", "b", "c"], "r0", 0.0)
    book.used(["a"], "r1", 1.0)  # a is the newest now
    book.used(["d"], "r1", 1.0)
    assert list(book.uses) == ["c", "a", "d"]
    book.forget("c")
    assert list(book.uses) == ["a", "d"]
    book.clear()
    assert not book.uses and book.typical is None
    with pytest.raises(ValueError):
        NextUse(limit=0)
    with pytest.raises(ValueError):
        NextUse(dead_after=1.0)


def hits(simulations: int, capacity: int, rounds: int, rank) -> int:
    """Simulations taking turns (0, 1, ..., S-1, 0, ...), each round reading its own item once
    a time unit; a cache of `capacity` items evicts by `rank(item, last read, now)`."""
    book, cached, last, found = NextUse(), set(), {}, 0
    for now in range(rounds):
        item = now % simulations
        if item in cached:
            found += 1
        elif len(cached) == capacity:
            cached.remove(min(cached, key=lambda i: (*rank(book, i, last[i], now), last[i])))
        cached.add(item)
        last[item] = now
        book.used([item], ("round", now), float(now))
    return found


@settings(max_examples=30, deadline=None)
@given(st.integers(3, 12), st.data())
def test_simulations_taking_turns_keep_hits_that_recency_loses(simulations, data):
    """S simulations in turn on a cache holding fewer than S: LRU evicts exactly the one due
    next and never hits; the predicted next read keeps capacity - 1 of them hitting."""
    capacity = data.draw(st.integers(2, simulations - 1))
    rounds = 10 * simulations
    lru = hits(simulations, capacity, rounds, lambda book, item, last, now: (1, 0.0))
    ours = hits(simulations, capacity, rounds, lambda book, item, last, now: book.rank(item, last, now))
    assert lru == 0
    assert ours >= (capacity - 1) * (rounds // simulations - 2)
