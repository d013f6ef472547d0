"""A client's hints on what a finished request's KV is worth: pin, retain, release.

A client that knows its workflow (an agent will speak again in a minute, a simulation has
ended) says so on the request (`"tokendance": {"pin_seconds": 60}`, the shape of
sgl-project/sglang#27574's programmatic KV hints); once the request ends, its cached KV
carries the hint:

* pin: not evictable until the deadline, within the server's pin budget (a share of the pool,
  so one client cannot hold it all; a pin past the budget is taken as a retain);
* retain: evicted only after everything not retained, until the deadline (still evictable:
  it never stops an allocation);
* release: evicted before everything else, unless something reads it again first.

A request may also name its `simulation`; the one that ends it (`end_simulation`) releases
what every request of that simulation left (`Simulations`).

This module is the books: which cached item holds which hint until when, and what each
simulation left; bounded (oldest dropped) and cleared with the cache. srt/hinted_kv.py applies
them to SGLang's tree and the Masters; srt/eviction.py ranks by `tier`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Iterable, NamedTuple, TypeVar

RELEASED, PLAIN, RETAINED = 0, 1, 2  # eviction tiers, first evicted first

Handle = TypeVar("Handle")


class KVHint(NamedTuple):
    """One request's hint: `kind` pin, retain or release; `seconds` (pin, retain) how long."""

    kind: str
    seconds: float | None = None

    def payload(self) -> dict:
        """The client's field for it (srt/request)."""
        return {"release": True} if self.kind == "release" else {f"{self.kind}_seconds": self.seconds}


class Mark(NamedTuple):
    tier: int
    at: float  # RETAINED: its deadline; RELEASED: when it was released


class Pin(NamedTuple, Generic[Handle]):
    handle: Handle  # what the caller unlocks when the pin ends (a tree node)
    until: float


class Hints(Generic[Handle]):
    """Marks (retain, release) by item key and pins by item key, with their deadlines."""

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self.marks: OrderedDict[Hashable, Mark] = OrderedDict()
        self.pins: dict[Hashable, Pin[Handle]] = {}

    def retain(self, keys: Iterable[Hashable], until: float) -> None:
        """Each item goes after every unretained one until `until` (a later deadline wins)."""
        for key in keys:
            old = self.marks.get(key)
            self._mark(key, Mark(RETAINED, until if old is None or old.tier != RETAINED else max(until, old.at)))

    def release(self, keys: Iterable[Hashable], now: float) -> None:
        """Each item goes first, until something reads it after `now`."""
        for key in keys:
            self._mark(key, Mark(RELEASED, now))

    def _mark(self, key: Hashable, mark: Mark) -> None:
        self.marks[key] = mark
        self.marks.move_to_end(key)
        while len(self.marks) > self.capacity:
            self.marks.popitem(last=False)

    def tier(self, key: Hashable, now: float, last_access: float) -> int:
        """Where the item ranks: RELEASED (unread since its release), PLAIN, or RETAINED (its
        deadline not passed)."""
        mark = self.marks.get(key)
        if mark is None:
            return PLAIN
        if mark.tier == RETAINED:
            return RETAINED if now < mark.at else PLAIN
        return RELEASED if last_access <= mark.at else PLAIN

    def pin(self, key: Hashable, handle: Handle, until: float) -> bool:
        """Record a pin; False when the item is pinned already (its deadline moved to the later
        one: the caller holds nothing more)."""
        old = self.pins.get(key)
        if old is not None:
            self.pins[key] = old._replace(until=max(until, old.until))
            return False
        self.pins[key] = Pin(handle, until)
        return True

    def expired(self, now: float) -> list[Handle]:
        """The pins whose deadline passed, forgotten: their handles, to unlock."""
        ended = [key for key, pin in self.pins.items() if pin.until <= now]
        return [self.pins.pop(key).handle for key in ended]

    def forget(self, key: Hashable) -> None:
        """An evicted item's mark."""
        self.marks.pop(key, None)

    def clear(self) -> None:
        """Everything forgotten (the cache was flushed, its locks with it)."""
        self.marks.clear()
        self.pins.clear()


class Simulations(Generic[Handle]):
    """What each simulation's finished requests left cached, until the simulation ends: the last
    nodes of their paths (`Handle`s) and the keys of their Masters, with the simulations that
    left each Master. Bounded: `capacity` simulations (the oldest forgotten), `per_simulation`
    handles each (the oldest dropped)."""

    def __init__(self, capacity: int = 1024, per_simulation: int = 4096):
        self.capacity, self.per_simulation = capacity, per_simulation
        self.left: OrderedDict[str, tuple[list[Handle], set[Hashable]]] = OrderedDict()
        self.touched: dict[Hashable, set[str]] = {}  # Master key -> the simulations that left it

    def record(self, simulation: str, ends: Iterable[Handle], masters: Iterable[Hashable]) -> None:
        handles, keys = self.left.setdefault(simulation, ([], set()))
        self.left.move_to_end(simulation)
        handles.extend(ends)
        del handles[:-self.per_simulation]
        for key in masters:
            keys.add(key)
            self.touched.setdefault(key, set()).add(simulation)
        while len(self.left) > self.capacity:
            self._drop(next(iter(self.left)))

    def end(self, simulation: str) -> tuple[list[Handle], list[Hashable]]:
        """The simulation's handles and the Masters no other simulation left; it is forgotten."""
        handles, keys = self.left.get(simulation, ([], set()))
        own = [key for key in keys if self.touched.get(key) == {simulation}]
        self._drop(simulation)
        return handles, own

    def forget_master(self, key: Hashable) -> None:
        """An evicted Master."""
        for simulation in self.touched.pop(key, ()):
            self.left[simulation][1].discard(key)

    def clear(self) -> None:
        self.left.clear()
        self.touched.clear()

    def _drop(self, simulation: str) -> None:
        _, keys = self.left.pop(simulation, ([], set()))
        for key in keys:
            others = self.touched.get(key)
            if others is not None:
                others.discard(simulation)
                if not others:
                    del self.touched[key]
