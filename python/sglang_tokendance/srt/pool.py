"""SGLang's token-to-KV-pool allocator with reference-counted slots and slot frames (mirror storage).

Under `--tokendance-storage mirror` a KV slot can have several owners (core/slot_refs): the
radix tree, the segment table's Masters, and every live request row that reads a Master in
place. SGLang frees a request's row, a tree leaf or a duplicate through `free`; here `free`
drops one reference per slot and a slot returns to the free list when its last reference
goes. With one owner per slot (all SGLang does by itself) this is SGLang's allocator. It also keeps
every slot's frame (core/slot_frames: the position its K was rotated at), which the attention
backend records and every reader of a slot in place needs.

Installed by an AFTER hook on `KVCacheConfigurator._build_token_to_kv_pool_allocator`, only
under mirror storage, and only where SGLang built its plain page-size-1 allocator: the hook
builds this subclass with the same arguments instead (dense storage keeps SGLang's own).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

from sglang_tokendance.core.slot_frames import SlotFrames
from sglang_tokendance.core.slot_refs import SlotRefs


class RefCountedAllocator(TokenToKVPoolAllocator):
    """A slot is free when its last owner frees it."""

    refs: SlotRefs
    frames: SlotFrames
    released: int = 0  # slots whose last reference went, ever (free now, or when a free group ends)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # one SlotFrames for the allocator's life: the attention backend and the storage hold
        # it, and a cache reset (`clear`) leaves it be -- whoever writes a slot next records
        # its frame, so a free slot's stale frame is never read
        self.frames = SlotFrames(self.size, self.device)

    def clear(self) -> None:
        super().clear()
        self.refs = SlotRefs(self.size, self.device)

    def alloc(self, need_size: int):
        slots = super().alloc(need_size)
        if slots is not None:
            self.refs.allocated(slots)
        return slots

    def free(self, free_index: torch.Tensor) -> None:
        """Drop one reference per slot. Inside SGLang's batched frees (a free group, during
        result processing) the references go now and the slots whose last one went reach the
        free list when the group ends; `released` counts them either way."""
        if free_index.numel() == 0:
            return
        released = self.refs.release(free_index.to(torch.int64))
        self.released += released.numel()
        if self.free_group is not None:
            self.free_group.append(released)
            return
        self._to_free_list(released)

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        if pending:
            self._to_free_list(torch.cat(pending))

    def share(self, slots: torch.Tensor) -> None:
        """One more owner (a tree node) takes a reference on each of `slots`."""
        self.refs.share(slots)

    def read(self, slots: torch.Tensor) -> None:
        """A request row reads `slots` (a Master's) in place: one reference each."""
        self.refs.read(slots)

    def unread(self, slots: torch.Tensor) -> None:
        """The row stops reading `slots` and drops those references."""
        self.refs.unread(slots)
        self.free(slots)

    def hold(self, slots: torch.Tensor) -> None:
        """A Master takes a reference on `slots`."""
        self.refs.hold(slots)

    def unhold(self, slots: torch.Tensor) -> None:
        """A Master drops its references (evicted, or the cache reset)."""
        released = self.refs.unhold(slots)
        self.released += released.numel()
        self._to_free_list(released)

    def _to_free_list(self, released: torch.Tensor) -> None:
        """Slots whose last reference went: SGLang's free list, now (their references are
        dropped already, so they must not pass through our `free` again)."""
        group, self.free_group = self.free_group, None
        try:
            super().free(released)
        finally:
            self.free_group = group


def install_allocator(allocator, *unused, **unused_kw):
    """AFTER hook on KVCacheConfigurator._build_token_to_kv_pool_allocator: SGLang's plain
    allocator becomes a RefCountedAllocator with the same arguments (nothing is allocated yet)."""
    if type(allocator) is not TokenToKVPoolAllocator:
        return allocator
    return RefCountedAllocator(allocator.size, dtype=allocator.dtype, device=allocator.device,
                               kvcache=allocator.get_kvcache(), need_sort=allocator.need_sort)
