"""Reference counts of KV-pool slots that several owners hold at once (Master-Mirror storage).

Under mirror storage one slot can be read by several requests at different offsets (each at its
shift from the slot's frame, core/slot_frames). A slot then has several owners: the radix tree (one reference per tree
node value), each cached segment (a Master) that holds it, and each live request row that
points at it. Every owner takes one reference and drops its own; the slot is free when the
last goes. On top of the plain count, `tree` counts the tree nodes holding each slot and
`locked` those of them a live request locks, `masters` the Master references, `reads` the live
rows reading it in place and `pins` the live rows reading a Master that holds it (a pinned
Master is not evictable). So the pool can say, counting each slot once however many owners it
has, how many slots eviction could free (`evictable_slots`: held by unlocked tree nodes and
unpinned Masters alone) and how many the live requests keep (`protected_slots`).
Those counts are kept as running totals: each change recounts only the slots it touches
(before and after), so the scheduler's several asks per step cost no scan of the pool.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


COUNTS = ("evictable", "protected", "tree", "masters", "master_only", "reads")  # the running totals


class DoubleFree(RuntimeError):
    """A slot lost more references than it was given: some owner freed it twice."""


class SlotRefs:
    """Per-slot counters over slots 0..size (slot 0 is SGLang's padding slot, never handed out)."""

    def __init__(self, size: int, device: torch.device | str = "cpu"):
        self.refs = torch.zeros(size + 1, dtype=torch.int32, device=device)
        self.tree = torch.zeros_like(self.refs)
        self.locked = torch.zeros_like(self.refs)
        self.masters = torch.zeros_like(self.refs)
        self.pins = torch.zeros_like(self.refs)
        self.reads = torch.zeros_like(self.refs)
        self._totals = torch.zeros(len(COUNTS), dtype=torch.int64, device=device)  # `_per_slot` summed

    def _per_slot(self, at: torch.Tensor) -> torch.Tensor:
        """[len(at), len(COUNTS)]: what each slot of `at` adds to each count."""
        refs, tree, masters = self.refs[at], self.tree[at], self.masters[at]
        evictable = _evictable(refs, tree, masters, self.locked[at], self.pins[at])
        held = (tree > 0) | (masters > 0)
        return torch.stack([evictable, held & ~evictable, tree > 0, masters > 0, (masters > 0) & (refs == masters),
                            self.reads[at]], 1).to(torch.int64)

    @contextlib.contextmanager
    def _changing(self, slots: torch.Tensor) -> Iterator[None]:
        """Around a change that touches `slots` only: the totals move by what it changed there."""
        at = torch.unique(slots)
        before = self._per_slot(at).sum(0)
        try:
            yield
        finally:
            self._totals += self._per_slot(at).sum(0) - before

    def _count(self, name: str) -> int:
        return int(self._totals[COUNTS.index(name)])

    def _add(self, counter: torch.Tensor, slots: torch.Tensor, delta: int) -> None:
        with self._changing(slots):
            counter.index_add_(0, slots, torch.full_like(slots, delta, dtype=torch.int32))

    def allocated(self, slots: torch.Tensor) -> None:
        """Fresh slots from the free list: one owner each."""
        with self._changing(slots):
            self.refs[slots] = 1

    def share(self, slots: torch.Tensor) -> None:
        """One more owner for each of `slots` (repeats count once per occurrence)."""
        self._add(self.refs, slots, 1)

    def release(self, slots: torch.Tensor) -> torch.Tensor:
        """Drop one reference per occurrence; returns the slots whose last reference went
        (each once), for the free list."""
        self._add(self.refs, slots, -1)
        left = self.refs[slots]
        if bool((left < 0).any()):
            wrong = torch.unique(slots[left < 0])
            with self._changing(wrong):
                self.refs[wrong] = 0
            raise DoubleFree(f"KV slots freed more often than referenced: {wrong[:8].tolist()}")
        return torch.unique(slots[left == 0])

    def hold(self, slots: torch.Tensor) -> None:
        """A Master takes a reference on `slots`."""
        self._add(self.masters, slots, 1)
        self.share(slots)

    def unhold(self, slots: torch.Tensor) -> torch.Tensor:
        """A Master drops its references; returns the slots now free."""
        self._add(self.masters, slots, -1)
        return self.release(slots)

    def read(self, slots: torch.Tensor) -> None:
        """A live row reads `slots` in place: its reference on each."""
        self._add(self.reads, slots, 1)
        self.share(slots)

    def unread(self, slots: torch.Tensor) -> None:
        """The row no longer reads `slots` (its references are dropped by whoever frees them)."""
        self._add(self.reads, slots, -1)

    def pin(self, slots: torch.Tensor) -> None:
        """A live row reads the Master holding `slots`: none of them is evictable meanwhile."""
        self._add(self.pins, slots, 1)

    def unpin(self, slots: torch.Tensor) -> None:
        self._add(self.pins, slots, -1)

    def tree_holds(self, slots: torch.Tensor, delta: int) -> None:
        """A tree node starts (+1: created, with the reference of the row it took them from or
        one its inserter shared) or stops (-1: evicted, its references freed next) holding
        `slots`."""
        self._add(self.tree, slots, delta)

    def tree_locks(self, slots: torch.Tensor, delta: int) -> None:
        """A tree node holding `slots` gets locked by a live request (+1: not evictable) or
        loses its last lock (-1)."""
        self._add(self.locked, slots, delta)

    def evictable_slots(self) -> int:
        """Slots evicting every unlocked tree node and every unpinned Master would free: held
        by those alone (no live row's own or reading reference, no lock, no pin)."""
        return self._count("evictable")

    def evictable_among(self, slots: torch.Tensor) -> int:
        """How many of `slots` (each once) are evictable now (`evictable_slots`' test)."""
        return int(self._per_slot(slots.unique())[:, COUNTS.index("evictable")].sum())

    def protected_slots(self) -> int:
        """Slots the tree or a Master holds that eviction cannot free now (locked, pinned, or
        also held by a live row)."""
        return self._count("protected")

    def tree_slots(self) -> int:
        """Slots some tree node holds (each once, however many nodes hold it)."""
        return self._count("tree")

    def master_slots(self) -> int:
        """Slots some Master holds (each once)."""
        return self._count("masters")

    def master_only_slots(self) -> int:
        """Slots held by Masters and by nobody else (not the tree, not a row)."""
        return self._count("master_only")

    def read_slots(self) -> int:
        """Row positions reading a slot in place (a slot read by two rows counts twice)."""
        return self._count("reads")


def _evictable(refs: torch.Tensor, tree: torch.Tensor, masters: torch.Tensor, locked: torch.Tensor,
               pins: torch.Tensor) -> torch.Tensor:
    """Per slot (the counters at some slots): held by unlocked tree nodes and unpinned Masters alone."""
    return (refs > 0) & (refs == tree + masters) & (locked == 0) & (pins == 0)
