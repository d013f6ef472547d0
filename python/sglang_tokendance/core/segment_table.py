"""Bookkeeping of cached segments: a key (the request's cache namespace and the segment's
content hash) -> the KV slots that hold the segment.

The segment-hash forest keeps one entry per key, whatever context and offset the segment was
first computed at: the first copy is kept and later ones are only counted. An entry carries
the fields SGLang's eviction strategies read off a radix-tree node (last access, creation
time, hit count, priority), so the forest evicts segments and tree leaves in one order under
any `--radix-eviction-policy`. Entries need no lock refs: a request uses an entry only while
its KV is copied into the request's own slots, right after allocation, when nothing can evict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

import torch


@dataclass(eq=False)
class SegmentEntry:
    key: Hashable
    slots: torch.Tensor  # one KV-pool slot per token, holding un-rotated K and V
    last_access_time: float = field(default_factory=time.monotonic)
    creation_time: float = field(default_factory=time.monotonic)
    hit_count: int = 0
    priority: int = 0  # SGLang's "priority" policy evicts low priorities first; segments take the default

    def __len__(self) -> int:
        return int(self.slots.numel())


class SegmentTable:
    """Entries by key and a running token count, so that the scheduler's per-step
    `evictable_size()` is O(1) however many segments are cached."""

    def __init__(self) -> None:
        self.entries: dict[Hashable, SegmentEntry] = {}
        self.tokens = 0
        self.inserted = 0
        self.duplicates = 0
        self.evicted = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def insert(self, key: Hashable, slots: torch.Tensor) -> SegmentEntry:
        """Add a new segment; the caller checks `in` first (a duplicate is only counted)."""
        if key in self.entries:
            raise KeyError(f"segment {key} is already cached")
        entry = SegmentEntry(key, slots)
        self.entries[key] = entry
        self.tokens += len(entry)
        self.inserted += 1
        return entry

    def count_duplicate(self, key: Hashable) -> None:
        self.duplicates += 1
        self.entries[key].last_access_time = time.monotonic()

    def lookup(self, key: Hashable) -> SegmentEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            entry.hit_count += 1
            entry.last_access_time = time.monotonic()
        return entry

    def remove(self, entry: SegmentEntry) -> torch.Tensor:
        """Drop an entry; returns its slots for the caller to free."""
        del self.entries[entry.key]
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
