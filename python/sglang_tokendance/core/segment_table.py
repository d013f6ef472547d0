"""Bookkeeping of cached segments: a key (the request's cache namespace and the segment's
content hash) -> the KV slots that hold the segment.

The segment-hash forest keeps one entry per key, whatever context and offset the segment was
first computed at: the first copy is kept and later ones are only counted. An entry carries
the fields SGLang's eviction strategies read off a radix-tree node (last access, creation
time, hit count, priority), so the forest evicts segments and tree leaves in one order under
any `--radix-eviction-policy`. Under dense storage a request uses an entry only while its KV is
copied into the request's own slots, right after allocation, when nothing can evict; under
Master-Mirror storage live rows read an entry's slots in place and count as its `readers`,
and an entry with readers is never evicted.

Integrity: an entry keeps the token ids it was cached for, and a lookup names the ids the
reader expects there. An entry that does not hold them (a hash collision, or any bookkeeping
fault) is refused and counted, never used: the reader computes those tokens itself.

An entry also keeps the keys of the segments right before and after it in its author's prompt:
a reader whose content-defined chunk beside a found one missed reads the tokens it shares with
that neighbour Master (core/plan), whose ids say how far they agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch


@dataclass(eq=False)
class SegmentEntry:
    key: Hashable
    slots: torch.Tensor  # one KV-pool slot per token (dense: a copy, K un-rotated; mirror: the author's, as written)
    ids: tuple[int, ...]  # the segment's token ids (an output segment has one slot fewer: its last token has no KV)
    position: int = 0  # where its first token sat when its KV was computed (elsewhere: read at a shift)
    last_access_time: float = field(default_factory=time.monotonic)
    creation_time: float = field(default_factory=time.monotonic)
    hit_count: int = 0
    priority: int = 0  # SGLang's "priority" policy evicts low priorities first; segments take the default
    readers: int = 0  # live rows reading the slots in place (Master-Mirror storage): not evictable meanwhile
    before: Hashable | None = None  # the key of the segment its author's prompt held right before it (None: none)
    after: Hashable | None = None  # and right after it

    def __len__(self) -> int:
        return int(self.slots.numel())

    def holds(self, ids: Sequence[int]) -> bool:
        return len(ids) == len(self.ids) and tuple(ids) == self.ids


class SegmentTable:
    """Entries by key and a running token count, so that the scheduler's per-step
    `evictable_size()` is O(1) however many segments are cached."""

    def __init__(self) -> None:
        self.entries: dict[Hashable, SegmentEntry] = {}
        self.tokens = 0
        self.inserted = 0
        self.duplicates = 0
        self.evicted = 0
        self.refused = 0
        self.superseded = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def insert(self, key: Hashable, slots: torch.Tensor, ids: Sequence[int], position: int = 0,
               neighbours: tuple[Hashable | None, Hashable | None] = (None, None)) -> SegmentEntry:
        """Add a new segment holding the KV of `ids` (all of them, or all but the last), computed
        at `position`, between the segments keyed `neighbours` in its author's prompt; the caller
        checks `in` first (a duplicate is only counted)."""
        if key in self.entries:
            raise KeyError(f"segment {key} is already cached")
        if not len(ids) - 1 <= slots.numel() <= len(ids):
            raise ValueError(f"{slots.numel()} slots cannot hold the KV of {len(ids)} token ids")
        entry = SegmentEntry(key, slots, tuple(ids), position, before=neighbours[0], after=neighbours[1])
        self.entries[key] = entry
        self.tokens += len(entry)
        self.inserted += 1
        return entry

    def count_duplicate(self, key: Hashable) -> None:
        self.duplicates += 1
        self.entries[key].last_access_time = time.monotonic()

    def holding(self, key: Hashable, ids: Sequence[int]) -> bool:
        """Whether an entry for `key` holds `ids`: a look, nothing counted or touched."""
        return self.peek(key, ids) is not None

    def peek(self, key: Hashable, ids: Sequence[int]) -> SegmentEntry | None:
        """The entry for `key` if it holds `ids`: a look (admission's estimate, a plan of later
        chunks), nothing counted or touched; `lookup` is the read that counts."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.holds(ids) else None

    def position(self, key: Hashable) -> int | None:
        """Where the Master under `key` was computed (None: none cached): a look."""
        entry = self.entries.get(key)
        return None if entry is None else entry.position

    def lookup(self, key: Hashable, ids: Sequence[int]) -> SegmentEntry | None:
        """The entry for `key` if it holds `ids`; a mismatching entry is refused (counted)."""
        entry = self.entries.get(key)
        if entry is not None and not entry.holds(ids):
            self.refused += 1
            return None
        if entry is not None:
            entry.hit_count += 1
            entry.last_access_time = time.monotonic()
        return entry

    def remove(self, entry: SegmentEntry, superseded: bool = False) -> torch.Tensor:
        """Drop an entry (evicted, or `superseded` by a copy computed in a closer context);
        returns its slots for the caller to free."""
        del self.entries[entry.key]
        self.tokens -= len(entry)
        if superseded:
            self.superseded += 1
        else:
            self.evicted += 1
        return entry.slots

    def clear(self) -> list[torch.Tensor]:
        slots = [e.slots for e in self.entries.values()]
        self.entries.clear()
        self.tokens = 0
        return slots

    def stats(self, bytes_per_token: int) -> dict:
        tokens = self.tokens
        return {
            "segment_nodes": len(self.entries),
            "segment_tokens": tokens,
            "segment_bytes": tokens * bytes_per_token,
            "segments_inserted": self.inserted,
            "segment_duplicates": self.duplicates,
            "segments_evicted": self.evicted,
            "segments_refused": self.refused,
            "segments_superseded": self.superseded,
        }
