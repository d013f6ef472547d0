"""core/segment_table: one entry per key, access fields for eviction, sizes."""

from __future__ import annotations

import pytest
import torch

from sglang_tokendance.core.segment_table import SegmentTable

IDS = [101, 7, 9000, 42, 5, 5, 17, 3]


def test_first_copy_kept_and_duplicates_counted():
    table = SegmentTable()
    first = table.insert("h1", torch.arange(4), IDS[:4])
    assert "h1" in table and table.inserted == 1
    table.count_duplicate("h1")
    assert table.duplicates == 1 and table.entries["h1"] is first
    with pytest.raises(KeyError):
        table.insert("h1", torch.arange(4, 8), IDS[:4])


def test_keys_are_opaque_so_namespaces_stay_apart():
    table = SegmentTable()
    table.insert(("salt-a", "h"), torch.arange(2), IDS[:2])
    assert ("salt-a", "h") in table and ("salt-b", "h") not in table
    assert table.lookup(("salt-b", "h"), IDS[:2]) is None


def test_lookups_and_duplicates_refresh_access_fields():
    table = SegmentTable()
    a = table.insert("a", torch.arange(2), IDS[:2])
    b = table.insert("b", torch.arange(2, 4), IDS[2:4])
    assert a.creation_time <= b.creation_time
    before = a.last_access_time
    assert table.lookup("a", IDS[:2]) is a and a.hit_count == 1 and a.last_access_time >= before
    assert a.last_access_time >= b.last_access_time
    table.count_duplicate("b")
    assert b.last_access_time >= a.last_access_time and b.hit_count == 0
    assert torch.equal(table.remove(b), torch.arange(2, 4)) and table.evicted == 1
    assert table.lookup("b", IDS[2:4]) is None and table.tokens == 2


def test_clear_returns_all_slots_and_stats_count_bytes():
    table = SegmentTable()
    table.insert("a", torch.arange(2), IDS[:2])
    table.insert("b", torch.arange(2, 5), IDS[:3])
    stats = table.stats(bytes_per_token=10)
    assert stats["segment_tokens"] == 5 == table.tokens and stats["segment_bytes"] == 50
    assert sorted(int(x) for s in table.clear() for x in s) == [0, 1, 2, 3, 4]
    assert table.stats(10)["segment_nodes"] == 0


def test_an_entry_that_does_not_hold_the_readers_ids_is_refused():
    table = SegmentTable()
    entry = table.insert("h", torch.arange(4), IDS[:4])
    assert table.lookup("h", [101, 7, 9000, 43]) is None  # other ids under the same key
    assert table.lookup("h", IDS[:3]) is None  # another length
    held, entry.ids = entry.ids, entry.ids[:-1] + (entry.ids[-1] ^ 1,)  # a corrupted entry
    assert table.lookup("h", IDS[:4]) is None
    assert table.refused == 3 and entry.hit_count == 0 and table.stats(1)["segments_refused"] == 3
    entry.ids = held
    assert table.lookup("h", IDS[:4]) is entry
    output = table.insert("out", torch.arange(4, 7), IDS[:4])  # an output: its last token has no KV
    assert table.lookup("out", IDS[:4]) is output
    with pytest.raises(ValueError, match="cannot hold"):
        table.insert("bad", torch.arange(2), IDS[:4])
