"""A finished request's hint (pin, retain, release: core/hints.py) applied to what it leaves cached.

When a request that carries a hint is released (srt/forest.on_release), the hint goes to:
* its tree path: the exact prefix it matched and published, up to the root;
* under mirror storage, its kept row (srt/kept_mirrors), a path of its own namespace;
* the Masters of its segments and those its row read (pin and retain).

Release marks only what the request alone leaves: the tail of each path below the last node
that another cached path branches from or a live request holds (a shared system prompt stays
where recency puts it), and no Master (Masters are shared by nature).
A pin locks each path's last node with SGLang's own lock (`inc_lock_ref`: the path counts as
protected, SGLang's pool check included, and is never evicted) until its deadline, when the
pin budget (`--tokendance-max-pinned-share` of the pool) has room for the tokens it would newly
protect; its Masters are retained as long. A pin past the budget is a retain (counted).
Deadlines end lazily, whenever the cache is asked what it can evict or shows its stats.

A request naming its `simulation` has what it leaves booked under it (the last nodes, weakly:
an evicted node is not kept alive; the Masters' keys). The request that ends the simulation
(`end_simulation`) releases all of it, as `release` does: each path's own tail, and the Masters
no other simulation left; the simulation is forgotten.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Iterable

from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_tokendance.core.hints import Hints, KVHint, Simulations
from sglang_tokendance.core.segment_table import SegmentEntry
from sglang_tokendance.srt.eviction import item_key, path_up
from sglang_tokendance.srt.request import RequestOptions

if TYPE_CHECKING:
    from sglang_tokendance.srt.forest import SegmentForest


class HintedKV:
    """The hints on one forest's cached items, and the pins it holds."""

    def __init__(self, forest: SegmentForest, max_pinned_tokens: int):
        self.forest = forest  # the tree whose nodes it locks (SGLang's inc_lock_ref / dec_lock_ref)
        self.max_pinned_tokens = max_pinned_tokens
        self.book: Hints[TreeNode] = Hints()
        self.simulations: Simulations[weakref.ref] = Simulations()
        self.clipped_pins = 0  # pins taken as retains: the budget was full
        self.ended_simulations = 0

    def on_finished(self, options: RequestOptions, paths: list[TreeNode | None], masters: list[SegmentEntry]) -> None:
        """A finished request left `paths` (their last nodes) and `masters` cached: its hint and
        its simulation's book take them; the request that ends its simulation releases it."""
        if options.hint is not None:
            self.apply(options.hint, paths, masters)
        if options.simulation is not None:
            self.record(options.simulation, paths, masters)
            if options.end_simulation:
                self.end(options.simulation)

    def apply(self, hint: KVHint, paths: Iterable[TreeNode | None], masters: Iterable[SegmentEntry]) -> None:
        """The hint of a released request on the last nodes of its cached `paths` and on `masters`."""
        now = time.monotonic()
        ends = [node for node in paths if node is not None and node is not self.forest.root_node]
        masters = list(masters)
        if hint.kind == "release":
            self.book.release([item_key(node) for end in ends for node in self._own_tail(end)], now)
            return
        until = now + hint.seconds
        if hint.kind == "pin" and self._pin(ends, until):
            ends = []
        self.book.retain([item_key(node) for end in ends for node in path_up(self.forest, end)]
                         + [item_key(entry) for entry in masters], until)

    def record(self, simulation: str, paths: Iterable[TreeNode | None], masters: Iterable[SegmentEntry]) -> None:
        """A released request of `simulation` left these."""
        self.simulations.record(simulation, [weakref.ref(node) for node in paths if node is not None],
                                [item_key(entry) for entry in masters])

    def end(self, simulation: str) -> None:
        """The simulation ended: what its requests left goes first."""
        handles, masters = self.simulations.end(simulation)
        now = time.monotonic()
        ends = [node for node in (handle() for handle in handles) if node is not None and self._attached(node)]
        self.book.release([item_key(node) for end in ends for node in self._own_tail(end)] + masters, now)
        self.ended_simulations += 1

    def tier(self, item: TreeNode | SegmentEntry, now: float) -> int:
        """The item's eviction tier (core/hints: released first, retained last)."""
        return self.book.tier(item_key(item), now, item.last_access_time)

    def end_pins(self) -> None:
        """Unlock the pins whose deadline passed."""
        if self.book.pins:
            for node in self.book.expired(time.monotonic()):
                self.forest.dec_lock_ref(node)

    def forget(self, item: TreeNode | SegmentEntry) -> None:
        self.book.forget(item_key(item))
        if isinstance(item, SegmentEntry):
            self.simulations.forget_master(item_key(item))

    def clear(self) -> None:
        """The cache was flushed: its nodes and their locks are gone with it."""
        self.book.clear()
        self.simulations.clear()

    def pinned_tokens(self) -> int:
        """Tokens of the tree the pins hold, each node once."""
        return sum(len(node.key) for node in self._pinned_nodes().values())

    def stats(self) -> dict:
        self.end_pins()
        return {"hint_pins": len(self.book.pins), "hint_pinned_tokens": self.pinned_tokens(),
                "hint_pins_clipped": self.clipped_pins, "hint_marks": len(self.book.marks),
                "simulations_booked": len(self.simulations.left), "simulations_ended": self.ended_simulations}

    def _pin(self, ends: list[TreeNode], until: float) -> bool:
        """Lock each path's last node until `until`, if the budget has room for every token they
        newly protect; False (nothing locked): a retain instead."""
        held = self._pinned_nodes()
        new = {id(node): node for end in ends for node in path_up(self.forest, end) if id(node) not in held}
        if not ends or sum(len(node.key) for node in (*held.values(), *new.values())) > self.max_pinned_tokens:
            self.clipped_pins += bool(ends)
            return False
        for end in ends:
            if self.book.pin(id(end), end, until):
                self.forest.inc_lock_ref(end)
        return True

    def _pinned_nodes(self) -> dict[int, TreeNode]:
        return {id(node): node for pin in self.book.pins.values() for node in path_up(self.forest, pin.handle)}

    def _attached(self, node: TreeNode) -> bool:
        """Whether `node` is still in the tree (an evicted node is cut from its parent)."""
        while node is not self.forest.root_node:
            parent = node.parent
            if parent is None or all(child is not node for child in parent.children.values()):
                return False
            node = parent
        return True

    def _own_tail(self, node: TreeNode) -> list[TreeNode]:
        """The nodes of `node`'s path that no other cached path and no live request holds: from
        `node` up, while the node has no other child and no lock."""
        tail, below = [], None
        while node is not None and node is not self.forest.root_node and node.lock_ref == 0 \
                and all(child is below for child in node.children.values()):
            tail.append(node)
            below, node = node, node.parent
        return tail
