"""Reference-counted KV slots (core/slot_refs, srt/pool): a slot shared by the tree, Masters and
request rows returns to the free list only when its last owner frees it, whatever the order;
Masters' slots are counted once, and only unpinned Masters' slots held by nobody else count as
evictable."""

from __future__ import annotations

import pytest
import torch

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
