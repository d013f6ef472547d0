"""How many of the radix tree's nodes hold, and lock, each KV slot (mirror storage).

Under mirror storage a slot can be held by several tree nodes (an agent's kept Mirror holds
the slots of the shared tree's exact prefix too, srt/kept_mirrors.py), by segments (Masters)
and by live rows (core/slot_refs). SGLang's tree counts its evictable and protected sizes in
token positions, one slot per position. The forest keeps the slots' own counts beside them: a
node's slots count one more tree owner when SGLang's insert creates it and one less when it is
evicted, and one more lock while its lock count is above 0, so the forest counts each slot
once (`SegmentForest.evictable_size`, `protected_size`). Splits move slots between nodes and
change no count. The forest calls these from its overrides of SGLang's `_insert_helper`,
`inc_lock_ref` and `dec_lock_ref` and from its eviction.
"""

from __future__ import annotations

from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_tokendance.srt.pool import RefCountedAllocator


class TreeSlotCounts:
    def __init__(self, allocator: RefCountedAllocator | None):
        self.allocator = allocator  # whose `refs` count each slot (None: dense storage, one owner a slot)

    def inserted(self, node: TreeNode) -> None:
        """SGLang's insert created `node`: its slots count one more tree owner (with the
        reference of the row it took them from, or one its inserter shared)."""
        if self.allocator is not None:
            self.allocator.refs.tree_holds(node.value, 1)

    def evicted(self, node: TreeNode) -> None:
        """An evicted node no longer holds its slots (its references are freed next)."""
        if self.allocator is not None:
            self.allocator.refs.tree_holds(node.value, -1)

    def path_at(self, node: TreeNode, root: TreeNode, lock_ref: int) -> list[TreeNode]:
        """The nodes from `node` up to `root` whose lock count is `lock_ref`: those whose slots
        a lock change opens (0) or closes (1)."""
        path = []
        while self.allocator is not None and node is not None and node is not root:
            if node.lock_ref == lock_ref:
                path.append(node)
            node = node.parent
        return path

    def locked(self, nodes: list[TreeNode], delta: int) -> None:
        """The slots of `nodes` count `delta` more tree locks."""
        for node in nodes:
            self.allocator.refs.tree_locks(node.value, delta)
