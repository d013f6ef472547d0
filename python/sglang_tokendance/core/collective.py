"""Round groups: which requests of one multi-agent round are admitted together, and when.

A round's requests reach the server at slightly different times; prefilled as one group they
can share one batched re-rotation and deviation check (the collective prefill). The grouper
holds a round's members until all `size` have arrived or `window_s` has passed since its
first member, then releases the group; a request without a round is never held. A round is
named by the client (`RoundTag`), or inferred: with `min_shared` > 0 a request without a tag
joins the open inferred round of its namespace whose segment hashes it shares at least
`min_shared` of (a round with no known size is held for its whole window).

With `lead`, a released group of two or more members goes in two steps: its leader first
(the member holding the most of the group's segments), then, once the caller says the
leader's prefill is done (`release_due`'s `led`), the others -- with them any member of the
round that arrives meanwhile (a round released short by its window still gets one leader). The server computes the
leader's prompt exactly and its blocks' KV -- computed in round context, after the
messages that precede them -- becomes their Masters, so the others read blocks computed in
a context close to their own rather than their authors' (where the error of a reused block
grows with the messages its author never saw: core/selection's notes).

Pure bookkeeping over opaque hashable items and a caller-supplied clock, so it is tested
without SGLang; srt/policy.py feeds it SGLang's Req objects and the scheduler's waiting
queue. A group lives from its first arrival until its last member is admitted or leaves, and
carries its members (`RoundGroup.members`), so the blended prefill can find a request's
group; what outlives it is a `RoundRecord` of counts only.

`share_runs` is the collective blended prefill's view of a group that shares an extend batch:
which reused runs of its members read the same segment (they get one kept set, core/selection)
and which skip the probe and adopt that set (core/blend).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Iterable, Sequence, TypeVar

MAX_ROUND_SIZE = 4096  # a larger `round_size` is refused (a 400)
MAX_ROUND_ID_CHARS = 256
RECENT_ROUNDS = 64  # records kept for /server_info

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True)
class RoundTag:
    """A request's round as its client named it; `size` None: unknown (held for the window)."""

    round_id: str
    size: int | None = None


@dataclass
class RoundRecord:
    """What is reported about one released round (no request objects: it may outlive them)."""

    round_id: str
    inferred: bool
    members: int  # members that had arrived when it was released
    fallback: bool  # its window expired before `size` members arrived
    wait_s: float  # summed over members: release time - arrival time
    admitted: list[int] = field(default_factory=list)  # members admitted per prefill batch
    led: bool = False  # its leader went first, the others after its prefill


@dataclass
class RoundGroup(Generic[T]):
    """One round's members, held until released, then kept until each is admitted."""

    key: Hashable  # (namespace, round id) or (namespace, inferred serial)
    round_id: str
    size: int | None
    opened: float  # arrival time of its first member
    inferred: bool
    members: dict[T, tuple[str, ...]] = field(default_factory=dict)  # member -> sorted segment hashes
    arrivals: dict[T, float] = field(default_factory=dict)
    hashes: set[str] = field(default_factory=set)  # union of the members' segment hashes
    arrived: int = 0  # members that arrived, including ones that left since
    record: RoundRecord | None = None  # set on release
    leader: T | None = None  # released first; the others are held until its prefill is done
    released_at: float = 0.0

    @property
    def released(self) -> bool:
        return self.record is not None

    def follows(self, item: T) -> bool:
        """Whether `item` is held behind its group's leader."""
        return self.leader is not None and item != self.leader

    def choose_leader(self) -> T:
        """The member that holds the most of the group's segments (the first to arrive, of equals)."""
        return max(self.members, key=lambda m: len(self.members[m]))

    def due(self, now: float, window_s: float) -> bool:
        complete = self.size is not None and self.arrived >= self.size
        return complete or now - self.opened >= window_s


class RoundGrouper(Generic[T]):
    def __init__(self, window_s: float, min_shared: int = 0, lead: bool = False):
        self.window_s = window_s
        self.min_shared = min_shared
        self.lead = lead  # released groups go leader first (see the module's notes)
        self.open: dict[Hashable, RoundGroup[T]] = {}  # holding, by key, in opening order
        self.leading: dict[int, RoundGroup[T]] = {}  # by id (a round id may reopen): released, the others waiting
        self.group_of: dict[T, RoundGroup[T]] = {}  # members held, or released and not yet admitted
        self.free: set[T] = set()  # known items with no group (never held)
        self.stragglers: dict[Hashable, tuple[float, int | None]] = {}  # key -> (closed at, members still due)
        self.recent: deque[RoundRecord] = deque(maxlen=RECENT_ROUNDS)
        self.rounds = self.members = self.fallbacks = self.largest_admitted = self.led = 0
        self.wait_s = 0.0
        self._serial = itertools.count()

    # --- arrivals ---------------------------------------------------------------------------

    def knows(self, item: T) -> bool:
        return item in self.group_of or item in self.free

    def arrive(self, item: T, namespace: Hashable, tag: RoundTag | None, hashes: Iterable[str],
               now: float) -> RoundGroup[T] | None:
        """A request seen for the first time: the group it joins (held), or None (free)."""
        hashes = tuple(sorted(set(hashes)))
        group = self._group_for(namespace, tag, hashes, now)
        if group is None:
            self.free.add(item)
            return None
        self._join(item, group, hashes, now)
        return group

    def follow(self, item: T, leader: T, namespace: Hashable, hashes: Iterable[str],
               now: float) -> tuple[RoundGroup[T], bool]:
        """A request arriving while `leader`, admitted already, is computing segments it holds
        at another offset: held behind it as a late member of an inferred round it leads, until
        its prefill is done (`release_due`'s `led`), then it reads them from their Masters
        instead of computing them again. The group, and whether it was opened now."""
        group = next((g for g in self.leading.values() if g.inferred and g.leader is leader), None)
        opened = group is None
        if opened:
            serial = next(self._serial)
            group = RoundGroup((namespace, serial), f"inferred-{serial}", None, now, inferred=True,
                               leader=leader, released_at=now)
            group.record = RoundRecord(group.round_id, True, 1, False, 0.0, led=True)  # its leader
            self.leading[id(group)] = group
            self.rounds += 1
            self.members += 1
            self.led += 1
            self.recent.append(group.record)
        self._join(item, group, tuple(sorted(set(hashes))), now)
        return group, opened

    def _join(self, item: T, group: RoundGroup[T], hashes: tuple[str, ...], now: float) -> None:
        group.members[item] = hashes
        group.arrivals[item] = now
        group.hashes.update(hashes)
        group.arrived += 1
        if group.record is not None:  # a late member behind a leader still prefilling
            group.record.members += 1
            self.members += 1
        self.group_of[item] = group

    def _group_for(self, namespace: Hashable, tag: RoundTag | None, hashes: tuple[str, ...],
                   now: float) -> RoundGroup[T] | None:
        if tag is not None:
            key = (namespace, tag.round_id)
            if key in self.open:
                return self.open[key]
            led = next((g for g in self.leading.values() if g.key == key and g.leader is not None
                        and (g.size is None or g.arrived < g.size)), None)
            if led is not None:
                return led  # a late member joins the others behind the leader still prefilling
            # (a round complete already: the round id names the next round now)
            if self._straggler(key, now):
                return None
            return self._open(RoundGroup(key, tag.round_id, tag.size, now, inferred=False))
        if self.min_shared <= 0 or len(hashes) < self.min_shared:
            return None
        for group in self.open.values():
            if group.inferred and group.key[0] == namespace and len(group.hashes.intersection(hashes)) >= \
                    self.min_shared:
                return group
        serial = next(self._serial)
        return self._open(RoundGroup((namespace, serial), f"inferred-{serial}", None, now, inferred=True))

    def _open(self, group: RoundGroup[T]) -> RoundGroup[T]:
        self.open[group.key] = group
        return group

    def _straggler(self, key: Hashable, now: float) -> bool:
        """A late member of a round released in the last window passes at once."""
        closed, due = self.stragglers.get(key, (None, None))
        if closed is None or now - closed >= self.window_s:
            self.stragglers.pop(key, None)
            return False
        if due is not None:
            if due <= 1:
                del self.stragglers[key]
            else:
                self.stragglers[key] = (closed, due - 1)
        return True

    # --- release, admission, departure ------------------------------------------------------

    def is_held(self, item: T) -> bool:
        group = self.group_of.get(item)
        return group is not None and (not group.released or group.follows(item))

    def leads(self, item: T) -> bool:
        """Whether `item` is a released group's leader, not yet admitted."""
        group = self.group_of.get(item)
        return group is not None and group.released and group.leader == item

    def release_due(self, now: float, led: Callable[[T], bool] = lambda leader: True) -> list[RoundRecord]:
        """Release every open group that is complete or whose window has expired (with `lead`:
        its leader alone), and the others of every group whose leader `led` says is done."""
        self.stragglers = {k: v for k, v in self.stragglers.items() if now - v[0] < self.window_s}
        released = []
        for key, group in list(self.open.items()):
            if not group.due(now, self.window_s):
                continue
            del self.open[key]
            fallback = group.size is not None and group.arrived < group.size
            wait = sum(now - t for t in group.arrivals.values())
            group.record = RoundRecord(group.round_id, group.inferred, group.arrived, fallback, wait)
            self.rounds += 1
            self.members += group.arrived
            self.fallbacks += fallback
            self.wait_s += wait
            self.recent.append(group.record)
            if not group.inferred and (group.size is None or fallback):
                self.stragglers[key] = (now, None if group.size is None else group.size - group.arrived)
            if self.lead and len(group.members) >= 2:
                group.leader, group.released_at, group.record.led = group.choose_leader(), now, True
                self.leading[id(group)] = group
                self.led += 1
            released.append(group.record)
        for group in list(self.leading.values()):
            if group.leader is None or led(group.leader):
                self._follow(group, now)
        return released

    def _follow(self, group: RoundGroup[T], now: float) -> None:
        """The leader's prefill is done (or it left): the others go, their wait counted."""
        del self.leading[id(group)]
        group.leader = None
        wait = sum(now - max(group.released_at, group.arrivals[m]) for m in group.members)
        group.record.wait_s += wait
        self.wait_s += wait

    def admitted(self, items: Iterable[T]) -> None:
        """One prefill batch was formed from `items`: its members are no longer tracked."""
        counts: dict[int, tuple[RoundGroup[T], int]] = {}
        for item in items:
            self.free.discard(item)
            group = self.group_of.get(item)
            if group is None or not group.released:
                continue
            self._forget(item, group, admitted=True)
            counts[id(group)] = (group, counts.get(id(group), (group, 0))[1] + 1)
        for group, count in counts.values():
            group.record.admitted.append(count)
            self.largest_admitted = max(self.largest_admitted, count)

    def keep_only(self, present: Iterable[T]) -> None:
        """Forget every tracked item not in `present` (the waiting queue): it was aborted or
        otherwise left SGLang's queue. A held group keeps counting it as arrived."""
        present = set(present)
        self.free.intersection_update(present)
        for item in [i for i in self.group_of if i not in present]:
            self._forget(item, self.group_of[item])

    def _forget(self, item: T, group: RoundGroup[T], admitted: bool = False) -> None:
        del self.group_of[item]
        del group.members[item]
        group.arrivals.pop(item, None)
        if group.leader == item and not admitted:
            group.leader = None  # it left before its prefill: the others go without it
        if not group.members and not group.released:
            del self.open[group.key]  # nobody left to hold
        if not group.members and group.leader is None:
            self.leading.pop(id(group), None)

    # --- order ------------------------------------------------------------------------------

    def order(self, queue: list[T]) -> list[T]:
        """`queue` with each released group's waiting members moved together, to where its
        first member stands, and members with the same segments next to each other (so a
        prefill budget that splits the group splits it between segment sets). Everything
        else keeps its place and order."""
        waiting: dict[int, list[T]] = {}  # each released group's members in the queue, in its order
        for item in queue:
            group = self.group_of.get(item)
            if group is not None and group.released:
                waiting.setdefault(id(group), []).append(item)
        out: list[T] = []
        for item in queue:
            group = self.group_of.get(item)
            if group is None or not group.released:
                out.append(item)
            elif id(group) in waiting:
                members = waiting.pop(id(group))
                first_seen = {}
                for m in members:
                    first_seen.setdefault(group.members[m], len(first_seen))
                out.extend(sorted(members, key=lambda m: first_seen[group.members[m]]))
        return out

    # --- reporting --------------------------------------------------------------------------

    def stats(self) -> dict:
        return {
            "rounds_formed": self.rounds,
            "mean_group_size": self.members / self.rounds if self.rounds else 0.0,
            "fallbacks": self.fallbacks,
            "wait_added_s": self.wait_s,
            "largest_group_admitted": self.largest_admitted,
            "led_rounds": self.led,
            "held_requests": sum(self.is_held(i) for i in self.group_of),
            "tracked_requests": len(self.group_of) + len(self.free),
            "open_rounds": len(self.open),
            "recent_rounds": [vars(r) | {"admitted": list(r.admitted)} for r in self.recent],
        }


# --- the collective blended prefill -------------------------------------------------------


@dataclass(frozen=True)
class GroupRun:
    """A reused run of a request as the collective prefill sees it: which cached segment
    (None: unknown, never shared), the run's first token's offset in it, and its length."""

    segment: Hashable | None
    offset: int
    length: int


def share_runs(groups: Sequence[Hashable | None], runs: Sequence[Sequence[GroupRun]], probers: int = 0
               ) -> tuple[list[list[tuple[Hashable, Hashable] | None]], list[list[bool]]]:
    """Which runs of a batch's requests (`groups`: each one's round group or None; `runs`: each
    one's reused runs) share one kept set, and which of those skip the probe.

    A segment is shared when at least two members of a group read it (its k-th occurrence in
    each member being one shared segment): each such run gets the tag (group, (segment, k)),
    every other run None. With `probers` > 0 only the first `probers` members (batch order)
    reading a shared segment probe it; a later member's run adopts the group's choice when
    one prober's run covers its offsets (otherwise it probes too: under chunked prefill the
    members may hold different pieces of a segment)."""
    readers: dict[tuple[Hashable, Hashable], list[tuple[int, int]]] = {}  # tag -> (request, run index)
    keys: list[list[tuple[Hashable, Hashable] | None]] = []
    for request, (group, request_runs) in enumerate(zip(groups, runs)):
        seen: dict[Hashable, int] = {}
        keys.append([])
        for index, run in enumerate(request_runs):
            if group is None or run.segment is None:
                keys[-1].append(None)
                continue
            occurrence = seen[run.segment] = seen.get(run.segment, -1) + 1
            tag = (group, (run.segment, occurrence))
            keys[-1].append(tag)
            readers.setdefault(tag, []).append((request, index))
    adopted = [[False] * len(request_runs) for request_runs in runs]
    for tag, where in readers.items():
        if len({request for request, _ in where}) < 2:
            for request, index in where:
                keys[request][index] = None
            continue
        if probers <= 0:
            continue
        probing = [runs[request][index] for request, index in where[:probers]]
        for request, index in where[probers:]:
            run = runs[request][index]
            adopted[request][index] = any(p.offset <= run.offset and run.offset + run.length <= p.offset + p.length
                                          for p in probing)
    return keys, adopted
