"""When a cached item will be read next, predicted from when it was read before.

Simulations read their KV in rounds: an agent's history and the round's Masters are read by
its requests, the simulation steps its world (or other simulations' rounds run), and the next
round reads them again. Recency alone (SGLang's LRU) evicts exactly the simulation that has
waited longest, the one due first. This book keeps, per cached item (a tree node, a Master),
when a round last read it and the time between the rounds that read it (its period), so that
eviction can take first what no round will read soon:

* an item unread for `dead_after` of its periods (its simulation ended, or left it behind);
* then an item no round has read, only written (a prompt's private tail, an answer nobody
  quoted), in the caller's order;
* then the item whose next read (last read + period) is farthest (Belady's rule, predicted);
  an item read by one round only so far is predicted with the typical period of all items.

Reads by one round count once: a round's N requests reading a Master within a second are one
read, not a period of a second. A request outside any round is a round of its own. With no
period seen yet, nothing is predicted and the caller's order (SGLang's) decides.

Plain Python, bounded (the oldest entries go first), cleared with the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable

DEAD_AFTER_PERIODS = 3.0  # unread this many periods: no round is coming for it
SMOOTHING = 0.5  # weight of the newest period in a period's running estimate


@dataclass
class Use:
    last: float  # when a round last read the item
    round: Hashable  # the round that did
    period: float | None = None  # smoothed time between reads by different rounds (None: one round so far)


class NextUse:
    """Per item: its last read, the round that made it and its period (`used`); `rank` orders
    items for eviction, smaller first."""

    def __init__(self, limit: int = 1 << 16, dead_after: float = DEAD_AFTER_PERIODS) -> None:
        if limit < 1 or dead_after <= 1:
            raise ValueError(f"need limit >= 1 and dead_after > 1, got {limit}, {dead_after}")
        self.limit, self.dead_after = limit, dead_after
        self.uses: dict[Hashable, Use] = {}  # oldest read first
        self.typical: float | None = None  # the smoothed period over every item

    def used(self, items: Iterable[Hashable], round_key: Hashable, now: float) -> None:
        """`round_key`'s requests read `items` at `now`."""
        for item in items:
            use = self.uses.pop(item, None)
            if use is None:
                use = Use(now, round_key)
            elif use.round != round_key:
                gap = now - use.last
                use.period = gap if use.period is None else (1 - SMOOTHING) * use.period + SMOOTHING * gap
                self.typical = gap if self.typical is None else (1 - SMOOTHING) * self.typical + SMOOTHING * gap
                use.last, use.round = now, round_key
            else:
                use.last = now
            self.uses[item] = use  # now the newest
        while len(self.uses) > self.limit:
            del self.uses[next(iter(self.uses))]

    def periodic(self) -> int:
        """Items read by two rounds or more (with a period of their own)."""
        return sum(1 for use in self.uses.values() if use.period is not None)

    def forget(self, item: Hashable) -> None:
        self.uses.pop(item, None)

    def clear(self) -> None:
        self.uses.clear()
        self.typical = None

    def rank(self, item: Hashable, last_access: float, now: float) -> tuple[int, float]:
        """Eviction rank of `item` (smaller goes first), last touched at `last_access` by the
        cache's own clock: (0, 0) dead, (1, 0) never read by a round (written only: a prompt's
        tail, an answer), (2, -next read) the farthest first; (1, 0) for every item while no
        period is known."""
        use = self.uses.get(item)
        period = use.period if use is not None and use.period is not None else self.typical
        if period is None:
            return 1, 0.0
        last = use.last if use is not None else last_access
        if now - last > self.dead_after * period:
            return 0, 0.0
        if use is None:
            return 1, 0.0
        return 2, -(last + period)
