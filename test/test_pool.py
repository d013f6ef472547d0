"""Reference-counted KV slots (core/slot_refs, srt/pool): a slot shared by the tree, Masters and
request rows returns to the free list only when its last owner frees it, whatever the order;
Masters' slots are counted once, and only unpinned Masters' slots held by nobody else count as
evictable."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tokendance.core.slot_refs import DoubleFree, SlotRefs


def allocator(size: int = 16, need_sort: bool = False):
    from sglang_tokendance.srt.pool import RefCountedAllocator

    return RefCountedAllocator(size, dtype=torch.float32, device="cpu", kvcache=None, need_sort=need_sort)


def test_slot_refs_free_a_slot_with_its_last_reference():
    refs = SlotRefs(8)
    slots = torch.tensor([1, 2, 3])
    refs.allocated(slots)
    refs.share(torch.tensor([2, 3, 3]))  # a repeat counts twice
    assert refs.release(slots).tolist() == [1]
    assert refs.release(torch.tensor([3, 2])).tolist() == [2]
    assert refs.release(torch.tensor([3])).tolist() == [3]
    with pytest.raises(DoubleFree):
        refs.release(torch.tensor([3]))


def test_masters_are_counted_once_and_evictable_only_when_alone_and_unpinned():
    refs = SlotRefs(8)
    tree, row = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    refs.allocated(torch.cat([tree, row]))
    refs.tree_holds(tree, 1)  # the tree took over slots 1-3
    refs.hold(torch.tensor([2, 3, 4, 5]))  # a Master over tree slots 2, 3 and row slots 4, 5
    refs.hold(torch.tensor([3]))  # a second Master over slot 3
    assert refs.master_slots() == 4 and refs.master_only_slots() == 0
    assert refs.evictable_slots() == 3  # 4 and 5 are the live row's too
    assert refs.release(row).numel() == 0  # the row finished: 4, 5 are the Master's alone
    assert refs.master_only_slots() == 2 and refs.evictable_slots() == 5
    refs.pin(torch.tensor([2, 3, 4, 5]))  # a live row reads the Master
    assert refs.evictable_slots() == 1 and refs.protected_slots() == 4
    refs.unpin(torch.tensor([2, 3, 4, 5]))
    refs.tree_holds(tree, -1)
    assert refs.release(tree).tolist() == [1]  # the tree evicted its leaf: 2, 3 stay with the Masters
    assert refs.master_only_slots() == 4 == refs.evictable_slots()
    assert refs.unhold(torch.tensor([2, 3, 4, 5])).tolist() == [2, 4, 5]
    assert refs.unhold(torch.tensor([3])).tolist() == [3]
    assert refs.master_slots() == 0 == refs.evictable_slots()


def test_a_slot_several_tree_nodes_hold_is_counted_once_and_kept_by_any_lock():
    refs = SlotRefs(8)
    shared, own = torch.tensor([1, 2]), torch.tensor([3])
    refs.allocated(torch.cat([shared, own]))
    refs.tree_holds(shared, 1)  # one node holds 1, 2
    refs.share(torch.cat([shared, own]))
    refs.tree_holds(torch.cat([shared, own]), 1)  # a second node holds 1, 2 and 3 (with its own references)
    refs.release(own)  # the row that computed 3 finished
    assert refs.tree_slots() == 3 == refs.evictable_slots() and refs.protected_slots() == 0
    refs.tree_locks(shared, 1)  # a live request locks the first node
    assert (refs.evictable_slots(), refs.protected_slots()) == (1, 2)
    refs.tree_locks(shared, -1)
    refs.tree_holds(torch.cat([shared, own]), -1)
    assert refs.release(torch.cat([shared, own])).tolist() == [3]  # evicting the second frees 3 only
    assert refs.tree_slots() == 2 == refs.evictable_slots()


def test_rows_reading_in_place_keep_slots_from_eviction_and_count_per_position():
    refs = SlotRefs(8)
    slots = torch.tensor([1, 2, 3, 4])
    refs.allocated(slots)
    refs.tree_holds(slots, 1)  # the tree holds 1-4
    refs.hold(slots)
    refs.read(torch.tensor([3, 4, 4]))  # rows read 3 and 4 (4 twice)
    assert (refs.evictable_slots(), refs.protected_slots(), refs.read_slots()) == (2, 2, 3)
    refs.tree_holds(slots, -1)
    refs.release(slots)  # the tree evicts its leaf
    assert (refs.evictable_slots(), refs.master_only_slots(), refs.read_slots()) == (2, 2, 3)
    refs.release(torch.tensor([4, 4]))
    refs.unread(torch.tensor([4, 4]))  # both rows reading 4 end
    assert (refs.evictable_slots(), refs.master_only_slots(), refs.read_slots()) == (3, 3, 1)


@pytest.mark.parametrize("need_sort", [False, True])
def test_allocator_returns_a_shared_slot_when_its_last_owner_frees_it(need_sort):
    pool = allocator(need_sort=need_sort)
    slots = pool.alloc(4)
    assert pool.available_size() == 12
    pool.hold(slots[:2])  # a Master
    pool.read(slots[:2])  # a row reading it
    pool.free(slots)  # the author's row
    assert pool.available_size() == 14
    pool.free(slots[:2])  # SGLang frees the reader's row
    pool.refs.unread(slots[:2])
    assert pool.available_size() == 14 and pool.refs.master_only_slots() == 2
    pool.unhold(slots[:2])  # the Master is evicted
    assert pool.available_size() == 16
    with pytest.raises(DoubleFree):
        pool.free(slots[:1])


def test_allocator_counts_grouped_frees_when_the_group_ends():
    """SGLang batches frees between free_group_begin/end; a slot freed twice in one group by
    two owners is released once, at the end."""
    pool = allocator()
    slots = pool.alloc(3)
    pool.read(slots[1:])
    pool.free_group_begin()
    pool.free(slots)
    pool.free(slots[1:2])
    assert pool.available_size() == 13
    pool.free_group_end()
    assert pool.available_size() == 15 and pool.refs.refs[slots[2]] == 1


def test_allocator_behaves_as_sglangs_with_one_owner_per_slot():
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    ours, stock = allocator(), TokenToKVPoolAllocator(16, dtype=torch.float32, device="cpu", kvcache=None,
                                                      need_sort=False)
    for pool in (ours, stock):
        a, b = pool.alloc(5), pool.alloc(3)
        pool.free(a[1:3])
        pool.free(b)
        pool.alloc(4)
    assert torch.equal(ours.free_pages, stock.free_pages) and ours.available_size() == stock.available_size()
    ours.clear()
    assert ours.available_size() == 16 and not ours.refs.refs.any()


def test_the_hook_swaps_only_sglangs_plain_allocator():
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    from sglang_tokendance.srt.pool import RefCountedAllocator, install_allocator

    stock = TokenToKVPoolAllocator(16, dtype=torch.float32, device="cpu", kvcache=None, need_sort=True)
    ours = install_allocator(stock)
    assert type(ours) is RefCountedAllocator and (ours.size, ours.need_sort) == (16, True)
    other = object()
    assert install_allocator(other) is other


def test_a_master_dropped_inside_a_free_group_is_released_once():
    pool = allocator()
    slots = pool.alloc(2)
    pool.hold(slots)
    pool.free(slots)  # the author's row: the Master alone holds them
    pool.free_group_begin()
    pool.unhold(slots)  # evicted while SGLang batches its frees
    pool.free_group_end()
    assert pool.available_size() == 16 and not pool.refs.refs.any()


class OwnerModel:
    """An independent model of who holds each slot: rows (own slots and in-place reads), tree
    nodes (locked or not) and Masters (pinned or not). A slot is freeable when unlocked nodes
    and unpinned Masters are its only owners; SlotRefs must count the same."""

    def __init__(self, size: int):
        self.refs = SlotRefs(size)
        self.free = list(range(size, 0, -1))
        self.rows: list[list[int]] = []  # own slots
        self.nodes: list[tuple[list[int], list[bool]]] = []  # slots, [locked]
        self.masters: list[tuple[list[int], list[int]]] = []  # slots, [pins]
        self.reads: list[tuple[int, int]] = []  # (master, row position count) a row reads in place

    def run(self, op: str, a: int, b: int) -> None:
        t = lambda slots: torch.tensor(slots, dtype=torch.int64)  # noqa: E731
        if op == "row" and self.free:
            slots = [self.free.pop() for _ in range(min(1 + a % 4, len(self.free)))]
            self.refs.allocated(t(slots))
            self.rows.append(slots)
        elif op == "insert" and self.rows and self.rows[a % len(self.rows)]:  # the tree takes over own slots
            own = self.rows[a % len(self.rows)]
            taken, own[:] = own[:1 + b % len(own)], own[1 + b % len(own):]
            self.refs.tree_holds(t(taken), 1)
            self.nodes.append((taken, [False]))
        elif op == "share" and self.nodes:  # another node (a kept path) holds a node's slots too
            slots = self.nodes[a % len(self.nodes)][0]
            self.refs.share(t(slots))
            self.refs.tree_holds(t(slots), 1)
            self.nodes.append((list(slots), [False]))
        elif op == "lock" and self.nodes:
            slots, locked = self.nodes[a % len(self.nodes)]
            if locked[0] != bool(b % 2):
                locked[0] = bool(b % 2)
                self.refs.tree_locks(t(slots), 1 if locked[0] else -1)
        elif op == "evict" and self.nodes and not self.nodes[a % len(self.nodes)][1][0]:
            slots, _ = self.nodes.pop(a % len(self.nodes))
            self.refs.tree_holds(t(slots), -1)
            self._freed(self.refs.release(t(slots)))
        elif op == "master" and (self.nodes or any(self.rows)):
            pools = [n[0] for n in self.nodes] + [r for r in self.rows if r]
            slots = list(pools[a % len(pools)])
            self.refs.hold(t(slots))
            self.masters.append((slots, [0]))
        elif op == "read" and self.masters:  # a row reads a Master in place, pinning it
            slots, pins = self.masters[a % len(self.masters)]
            self.refs.read(t(slots))
            self.refs.pin(t(slots))
            pins[0] += 1
            self.reads.append((a % len(self.masters), len(slots)))
        elif op == "unread" and self.reads:
            index, _ = self.reads.pop(a % len(self.reads))
            slots, pins = self.masters[index]
            self.refs.unread(t(slots))
            self.refs.unpin(t(slots))
            pins[0] -= 1
            self._freed(self.refs.release(t(slots)))
        elif op == "drop_master" and self.masters and not self.masters[-1][1][0]:
            slots, _ = self.masters.pop()
            self._freed(self.refs.unhold(t(slots)))
        elif op == "free_row" and self.rows:
            own = self.rows.pop(a % len(self.rows))
            if own:
                self._freed(self.refs.release(t(own)))

    def _freed(self, slots: torch.Tensor) -> None:
        self.free += slots.tolist()

    def expected(self) -> tuple[int, int, int, int]:
        """(freeable, protected, tree-held, in use), counted from the owners."""
        owners: dict[int, list[bool]] = {}  # slot -> whether each owner is evictable
        tree_or_master: set[int] = set()
        for own in self.rows:
            for s in own:
                owners.setdefault(s, []).append(False)
        for index, _ in self.reads:
            for s in self.masters[index][0]:
                owners.setdefault(s, []).append(False)
        for slots, locked in self.nodes:
            for s in slots:
                owners.setdefault(s, []).append(not locked[0])
                tree_or_master.add(s)
        for slots, pins in self.masters:
            for s in slots:
                owners.setdefault(s, []).append(pins[0] == 0)
                tree_or_master.add(s)
        freeable = {s for s, flags in owners.items() if all(flags)}
        tree = {s for slots, _ in self.nodes for s in slots}
        return len(freeable), len(tree_or_master - freeable), len(tree), len(owners)

    def master_counts(self) -> tuple[int, int, int]:
        """(slots some Master holds, slots only Masters hold, row positions reading in place)."""
        held = {s for slots, _ in self.masters for s in slots}
        others = {s for own in self.rows for s in own} | {s for slots, _ in self.nodes for s in slots} | {
            s for index, _ in self.reads for s in self.masters[index][0]}
        return len(held), len(held - others), sum(n for _, n in self.reads)


OPS = ["row", "insert", "share", "lock", "evict", "master", "read", "unread", "drop_master", "free_row"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 50), st.integers(0, 50)), max_size=60))
def test_slot_counts_match_an_independent_model_of_owners(ops):
    """Whatever the order of allocations, tree inserts, kept paths sharing slots, locks,
    evictions, Masters, in-place reads and frees: each slot is counted once, evictable exactly
    when unlocked tree nodes and unpinned Masters are its only owners, and a slot returns to
    the free list when its last owner goes."""
    model = OwnerModel(24)
    for op, a, b in ops:
        model.run(op, a, b)
        freeable, protected, tree, used = model.expected()
        refs = model.refs
        assert (refs.evictable_slots(), refs.protected_slots(), refs.tree_slots()) == (freeable, protected, tree)
        assert int((refs.refs > 0).sum()) == used == 24 - len(model.free)
        assert (refs.master_slots(), refs.master_only_slots(), refs.read_slots()) == model.master_counts()
