"""One eviction order over the radix tree's leaves and the cached segments (Masters).

SGLang's `RadixCache.evict` pops evictable leaves by its eviction strategy's priority until
enough tokens are freed. The forest's eviction is that loop with three changes SGLang's loop
has no extension point for, so it is written here rather than called:

* segments are items of the same heap, ranked by the same strategy (`--radix-eviction-policy`);
  those the batch being allocated will read (dense storage) come after everything else;
* under mirror storage a slot can have several owners (core/slot_refs): an item counts the
  slots its eviction really frees, not its length (SGLang's count would let an allocation
  that evicted "enough" find the pool still short), and an item none of whose slots it alone
  holds (a leaf whose slots a Master also holds) comes after the items that free slots;
* an evicted node's slots count one tree owner fewer (srt/tree_slot_counts);
* clients' hints (srt/hinted_kv) before everything but the batch's own reads: what a finished
  request or simulation released goes first, even where it frees nothing yet (its co-owners,
  released too, then free its slots), what one retained last;
* (--tokendance-eviction next-use) then, before the strategy's priority, what no round will
  read soon goes first (core/next_use: the reads of every released request, by round).

Everything else -- the strategy's priority, `_delete_leaf`, a parent becoming a leaf, the KV
events and the eviction metrics -- is SGLang's.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import TYPE_CHECKING, Callable, Hashable

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_tokendance.core.segment_table import SegmentEntry
from sglang_tokendance.srt.kept_mirrors import is_kept

if TYPE_CHECKING:
    from sglang_tokendance.srt.forest import SegmentForest


def evict(forest: SegmentForest, params: EvictParams) -> EvictResult:
    """Free at least `params.num_tokens` slots (or everything evictable), each step evicting
    the leaf or segment the eviction strategy ranks first (O(log n) per item)."""
    if forest.disable:
        return EvictResult()
    start_time = time.perf_counter()
    order = itertools.count()  # ties never compare nodes
    priority = forest.eviction_strategy.get_priority
    allocator = forest.token_to_kv_pool_allocator
    book, hints, now = forest.next_use, forest.hints, time.monotonic()
    hints.end_pins()

    def entry(item, wanted: bool = False) -> tuple:  # the first of these ranks first
        due = (1, 0.0) if book is None else book.rank(item_key(item), item.last_access_time, now)
        return wanted, hints.tier(item, now), frees_nothing(forest, item), *due, priority(item), next(order), item

    heap = [entry(n) for n in forest.evictable_leaves]
    heap += [entry(e, id(e) in forest.batch.wanted) for e in forest.segments.entries.values() if not e.readers]
    heapq.heapify(heap)
    evicted = 0
    while evicted < params.num_tokens and heap:
        wanted, _, nothing, *_, item = heapq.heappop(heap)
        if not nothing and frees_nothing(forest, item):  # a co-owner's references changed since
            heapq.heappush(heap, entry(item, wanted))
            continue
        if book is not None:
            book.forget(item_key(item))
        hints.forget(item)
        if isinstance(item, SegmentEntry):
            freed = freed_by(forest, lambda: forest.storage.drop(item), len(item))
            evicted += freed
            forest.evicted_slots["master"] += freed
            continue
        forest.slot_counts.evicted(item)
        freed = freed_by(forest, lambda: allocator.free_segment(item.value, start_pos=0), len(item.value))
        evicted += freed
        forest.evicted_slots["kept_row" if is_kept(item) else "tree"] += freed
        forest._delete_leaf(item)
        if len(item.parent.children) == 0 and item.parent.lock_ref == 0:
            heapq.heappush(heap, entry(item.parent))
        forest.kv_events.record_remove(item)
    forest.update_eviction_metrics(evicted, start_time)
    forest.metrics.update_held()
    return EvictResult(num_tokens_evicted=evicted)


def item_key(item: TreeNode | SegmentEntry) -> Hashable:
    """A tree node or a Master, as core/next_use knows it (a node by its identity: SGLang's
    nodes carry nothing of ours; an evicted one is forgotten)."""
    return ("master", item.key) if isinstance(item, SegmentEntry) else id(item)


def record_reads(forest: SegmentForest, req, state) -> None:
    """A released request read the path of the prefix it matched (not the nodes it wrote
    after it) and (mirror storage) the Masters its row read in place: one read by its round
    (srt/policy's group, or the request alone). A request without reuse state records none."""
    if state is None:
        return
    items = [item_key(entry) for entry in state.reading] + [id(node) for node in path_up(forest, state.matched)]
    round_key = state.round if state.round is not None else ("request", req.rid)
    forest.next_use.used(items, round_key, time.monotonic())


def path_up(forest: SegmentForest, node: TreeNode | None) -> list[TreeNode]:
    """`node` and its ancestors below the root (none for None)."""
    path = []
    while node is not None and node is not forest.root_node:
        path.append(node)
        node = node.parent
    return path


def frees_nothing(forest: SegmentForest, item: TreeNode | SegmentEntry) -> bool:
    """Under mirror storage: every slot of `item` has another owner (evicting it alone frees
    no slot). Dense storage: never."""
    if not forest.zero_copy:
        return False
    slots = item.slots if isinstance(item, SegmentEntry) else item.value
    return not bool((forest.token_to_kv_pool_allocator.refs.refs[slots] == 1).any())


def freed_by(forest: SegmentForest, release: Callable[[], None], tokens: int) -> int:
    """Slots that `release` (dropping an evicted item's `tokens` references) frees, now or when
    SGLang's free group ends: all of them under dense storage; under mirror storage a slot
    another owner holds stays."""
    if not forest.zero_copy:
        release()
        return tokens
    before = forest.token_to_kv_pool_allocator.released
    release()
    return forest.token_to_kv_pool_allocator.released - before
