"""SGLang's radix tree over KV slots that several owners share (mirror storage).

Under mirror storage a slot can be held by several tree nodes (an agent's kept Mirror holds
the slots of the shared tree's exact prefix too, srt/kept_mirrors.py), by segments (Masters)
and by live rows (core/slot_refs). SGLang's tree counts its evictable and protected sizes in
token positions, one slot per position. This subclass keeps the slots' own counts instead: a
node's slots count one more tree owner when SGLang's insert creates it and one less when it
is evicted, and one more lock while its lock count is above 0, so the forest can count each
slot once (`SegmentForest.evictable_size`, `protected_size`). Splits move slots between nodes
and change no count.
"""

from __future__ import annotations

from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode


class SharedSlotTree(RadixCache):
    zero_copy: bool = False  # mirror storage: set by the subclass before SGLang's __init__

    def _insert_helper(self, node, key, value, priority: int = 0, inserted_len: int = 0):
        """SGLang's insert; a new node's slots count one more tree owner (with the reference of
        the row it took them from, or one its inserter shared)."""
        matched, last = super()._insert_helper(node, key, value, priority, inserted_len)
        if self.zero_copy and matched < len(key):
            self.token_to_kv_pool_allocator.refs.tree_holds(last.value, 1)
        return matched, last

    def leaves_tree(self, node: TreeNode) -> None:
        """An evicted node no longer holds its slots (its references are freed next)."""
        if self.zero_copy:
            self.token_to_kv_pool_allocator.refs.tree_holds(node.value, -1)

    def inc_lock_ref(self, node):
        opened = self._path_at_lock_ref(node, 0)
        result = super().inc_lock_ref(node)
        for locked in opened:
            self.token_to_kv_pool_allocator.refs.tree_locks(locked.value, 1)
        return result

    def dec_lock_ref(self, node, params=None):
        closing = self._path_at_lock_ref(node, 1)
        result = super().dec_lock_ref(node, params)
        for unlocked in closing:
            self.token_to_kv_pool_allocator.refs.tree_locks(unlocked.value, -1)
        return result

    def _path_at_lock_ref(self, node, lock_ref: int) -> list[TreeNode]:
        """Under mirror storage: the nodes from `node` up to the root whose lock count is
        `lock_ref` (those whose slots a lock change opens or closes)."""
        path = []
        if not self.zero_copy or self.disable:
            return path
        while node is not None and node is not self.root_node:
            if node.lock_ref == lock_ref:
                path.append(node)
            node = node.parent
        return path
