"""Reference counts of KV-pool slots that several owners hold at once (Master-Mirror storage).

Under mirror storage a slot's K is un-rotated, so one slot can be read by several requests at
different offsets. A slot then has several owners: the radix tree (one reference per tree
node value), each cached segment (a Master) that holds it, and each live request row that
points at it. Every owner takes one reference and drops its own; the slot is free when the
last goes. On top of the plain count, `masters` counts the Master references of each slot,
`reads` the live rows reading it in place and `pins` the live rows reading a Master that holds
it (a pinned Master is not evictable), so the pool can say how many slots eviction could
still free (`evictable_master_slots`), counting each slot once however many owners it has.
Those counts scan the pool, so each is kept until the next change (the scheduler asks for
them several times a step).
"""

from __future__ import annotations

from typing import Callable

import torch


class DoubleFree(RuntimeError):
    """A slot lost more references than it was given: some owner freed it twice."""


class SlotRefs:
    """Per-slot counters over slots 0..size (slot 0 is SGLang's padding slot, never handed out)."""

    def __init__(self, size: int, device: torch.device | str = "cpu"):
        self.refs = torch.zeros(size + 1, dtype=torch.int32, device=device)
        self.masters = torch.zeros_like(self.refs)
        self.pins = torch.zeros_like(self.refs)
        self.reads = torch.zeros_like(self.refs)
        self._counts: dict[str, int] = {}  # the pool scans since the last change

    def _changed(self) -> None:
        self._counts.clear()

    def _count(self, name: str, mask: Callable[[], torch.Tensor]) -> int:
        if name not in self._counts:
            self._counts[name] = int(mask().sum())
        return self._counts[name]

    def allocated(self, slots: torch.Tensor) -> None:
        """Fresh slots from the free list: one owner each."""
        self.refs[slots] = 1
        self._changed()

    def share(self, slots: torch.Tensor) -> None:
        """One more owner for each of `slots` (repeats count once per occurrence)."""
        self.refs.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
        self._changed()

    def release(self, slots: torch.Tensor) -> torch.Tensor:
        """Drop one reference per occurrence; returns the slots whose last reference went
        (each once), for the free list."""
        self.refs.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))
        self._changed()
        left = self.refs[slots]
        if bool((left < 0).any()):
            wrong = torch.unique(slots[left < 0])
            self.refs[wrong] = 0
            raise DoubleFree(f"KV slots freed more often than referenced: {wrong[:8].tolist()}")
        return torch.unique(slots[left == 0])

    def hold(self, slots: torch.Tensor) -> None:
        """A Master takes a reference on `slots`."""
        self.masters.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
        self.share(slots)

    def unhold(self, slots: torch.Tensor) -> torch.Tensor:
        """A Master drops its references; returns the slots now free."""
        self.masters.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))
        return self.release(slots)

    def read(self, slots: torch.Tensor) -> None:
        """A live row reads `slots` in place: its reference on each."""
        self.reads.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
        self.share(slots)

    def unread(self, slots: torch.Tensor) -> None:
        """The row no longer reads `slots` (its references are dropped by whoever frees them)."""
        self.reads.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))
        self._changed()

    def pin(self, slots: torch.Tensor) -> None:
        """A live row reads the Master holding `slots`: none of them is evictable meanwhile."""
        self.pins.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
        self._changed()

    def unpin(self, slots: torch.Tensor) -> None:
        self.pins.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))
        self._changed()

    def master_slots(self) -> int:
        """Slots some Master holds (each once)."""
        return self._count("masters", lambda: self.masters > 0)

    def master_only_slots(self) -> int:
        """Slots held by Masters and by nobody else (not the tree, not a row)."""
        return self._count("master_only", lambda: (self.masters > 0) & (self.refs == self.masters))

    def masters_off_tree_slots(self) -> int:
        """Slots held by Masters and read by rows, nobody else (the tree holds none of them)."""
        return self._count("off_tree", lambda: (self.masters > 0) & (self.refs == self.masters + self.reads))

    def read_slots(self) -> int:
        """Row positions reading a slot in place (a slot read by two rows counts twice)."""
        return self._count("reads", lambda: self.reads)

    def tree_slots_kept_by_readers(self) -> int:
        """Master slots the tree holds too that evicting the tree would not free: a live row
        reads them, or their Master is pinned."""
        return self._count("kept", lambda: (self.masters > 0) & (self.refs > self.masters + self.reads)
                           & ((self.pins > 0) | (self.reads > 0)))

    def evictable_master_slots(self) -> int:
        """Slots evicting every unpinned Master would free: held by Masters only, none pinned."""
        return self._count("evictable", lambda: (self.masters > 0) & (self.refs == self.masters) & (self.pins == 0))
