"""Bookkeeping of cached segments: content hash -> the KV slots that hold the segment.

The segment-hash forest keeps one entry per content hash, whatever context and offset the
segment was first computed at: the first copy is kept and later ones are only counted.
Entries are evictable in one LRU order with the radix tree's leaves (both read
`time.monotonic()`). They need no lock refs: a request uses an entry only while its KV is
copied into the request's own slots, right after allocation, when nothing can evict it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class SegmentEntry:
    hash: str
    slots: torch.Tensor  # one KV-pool slot per token, holding un-rotated K and V
    last_access_time: float = field(default_factory=time.monotonic)
    hits: int = 0

    def __len__(self) -> int:
        return int(self.slots.numel())


class SegmentTable:
    """Entries in LRU order (oldest first) and a running token count, so that the scheduler's
    per-step `evictable_size()` and finding the oldest segment are O(1) however many segments
    are cached (the tree-leaf side of the joint eviction is SGLang's own)."""

    def __init__(self) -> None:
        self.entries: OrderedDict[str, SegmentEntry] = OrderedDict()
        self.tokens = 0
        self.inserted = 0
        self.duplicates = 0
        self.evicted = 0

    def __contains__(self, segment_hash: str) -> bool:
        return segment_hash in self.entries

    def insert(self, segment_hash: str, slots: torch.Tensor) -> SegmentEntry:
        """Add a new segment; the caller checks `in` first (a duplicate is only counted)."""
        if segment_hash in self.entries:
            raise KeyError(f"segment {segment_hash} is already cached")
        entry = SegmentEntry(segment_hash, slots)
        self.entries[segment_hash] = entry
        self.tokens += len(entry)
        self.inserted += 1
        return entry

    def count_duplicate(self, segment_hash: str) -> None:
        self.duplicates += 1
        self._touch(self.entries[segment_hash])

    def lookup(self, segment_hash: str) -> SegmentEntry | None:
        entry = self.entries.get(segment_hash)
        if entry is not None:
            entry.hits += 1
            self._touch(entry)
        return entry

    def _touch(self, entry: SegmentEntry) -> None:
        entry.last_access_time = time.monotonic()
        self.entries.move_to_end(entry.hash)

    def oldest(self) -> SegmentEntry | None:
        return next(iter(self.entries.values()), None)

    def remove(self, entry: SegmentEntry) -> torch.Tensor:
        """Drop an entry; returns its slots for the caller to free."""
        del self.entries[entry.hash]
        self.tokens -= len(entry)
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
        }
