"""Round-group scheduling policy: SGLang's scheduler admits a round's requests together.

Grouping rules are core/collective.py's; this module only connects them to SGLang 0.5.23's
scheduler through HookRegistry:

* AROUND `Scheduler.get_new_batch_prefill` (the step that picks waiting requests for the next
  prefill batch): new arrivals in the waiting queue are registered (their `tokendance` round
  options and segment hashes ride in custom_params), due groups are released, and the
  requests still held are left out of the waiting queue for the length of the call, then put
  back where they stood. SGLang's own admission (prefill budget, chunked prefill, request
  limits) then splits a released group when it must. The batch formed is recorded.
* AFTER `SchedulePolicy.calc_priority` (where SGLang orders the waiting queue): each released
  group's members are moved next to each other, same segments adjacent.
* AFTER `Scheduler.abort_request`: held members that SGLang's abort removed from the waiting
  queue are forgotten at once (a held round keeps counting them as arrived).
* AFTER `Scheduler.get_internal_state`: /server_info shows the counts ("tokendance_rounds").

Under --tokendance-round-leader (the default) a released group's leader is admitted alone
first and the others stay held until its first token (`prefilled`); `leads(req)` tells the
forest, while SGLang builds the leader's batch, to compute it exactly and make its blocks
their Masters. An unnamed arrival holding segments that an admitted request is still computing
at another offset waits behind it the same way (`prefilling`: round 0's natural leader).

Held requests stay SGLang's waiting requests in every other respect (abort, /flush_cache
refusal, the idle check: a scheduler holding a request keeps polling, so windows expire).
Requests that already produced output (retracted ones) are never held. While SGLang builds a
batch (its `prepare_for_extend` included), `round_of(req)` gives each member's group, its
members with it: the hook for a collective blended prefill.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable

from sglang_tokendance.core.collective import RoundGroup, RoundGrouper
from sglang_tokendance.server_args import TokenDanceArgs
from sglang_tokendance.srt.metrics import NO_ROUND_METRICS, PrometheusRoundMetrics, RoundMetrics
from sglang_tokendance.srt.request import RequestOptions
from sglang_tokendance.srt.reuse import namespace_of

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SCHEDULE_POLICY = "sglang.srt.managers.schedule_policy.SchedulePolicy"


class RoundPolicy:
    """The scheduler process's round groups."""

    def __init__(self, args: TokenDanceArgs, options: Callable[[Any], RequestOptions], clock=time.monotonic,
                 cached_at: Callable[[Hashable], int | None] = lambda key: None):
        self.options = options  # each request's options, parsed once (srt/request)
        self.cached_at = cached_at  # where the Master of a (namespace, hash) was computed (srt/forest), or None
        self.grouper: RoundGrouper[Any] = RoundGrouper(args.round_window_ms / 1000, args.round_min_shared,
                                                       lead=args.round_leader)
        self.clock = clock
        self.metrics: RoundMetrics | None = None  # built on the first pass, when SGLang's are known
        # admitted requests holding segments, their prefill not done: what a later arrival may wait for
        self.prefilling: dict[Any, RequestOptions] = {}

    def get_new_batch_prefill(self, original, scheduler, *args, **kwargs):
        """AROUND hook: hide the held requests from SGLang's admission for this pass."""
        if self.metrics is None:
            self.metrics = _metrics_of(scheduler)
        before = scheduler.waiting_queue
        self.prefilling = {r: o for r, o in self.prefilling.items() if not prefilled(r)}
        self.register_arrivals(before)
        waited = self.grouper.wait_s
        for record in self.grouper.release_due(self.clock(), led=prefilled):
            self.metrics.count_round(record)
        self.metrics.count_wait(self.grouper.wait_s - waited)
        held = {id(r) for r in before if self.grouper.is_held(r)}
        if not held:
            plan = original(scheduler, *args, **kwargs)
        else:
            scheduler.waiting_queue = [r for r in before if id(r) not in held]
            try:
                plan = original(scheduler, *args, **kwargs)
            finally:
                scheduler.waiting_queue = _put_back(before, held, scheduler.waiting_queue)
        if plan.batch_to_run is not None:
            self.grouper.admitted(plan.batch_to_run.reqs)
            if self.grouper.min_shared > 0:
                self.prefilling.update((r, self.options(r)) for r in plan.batch_to_run.reqs
                                       if not prefilled(r) and self.options(r).spans)
        return plan

    def register_arrivals(self, waiting_queue: list) -> None:
        self.grouper.keep_only(waiting_queue)
        now = self.clock()
        arrivals = [req for req in waiting_queue if not self.grouper.knows(req)]
        places = self._places(waiting_queue) if arrivals and self.grouper.min_shared > 0 else {}
        for req in arrivals:
            options = self.options(req)
            if len(req.output_ids) > 0:  # retracted after decoding: never held again
                self.grouper.arrive(req, namespace_of(req), None, (), now)
                continue
            if options.round is None and (behind := self._prefilling_holder(req, options)) is not None:
                group, opened = self.grouper.follow(req, *behind, now)
                if opened:
                    self.metrics.count_round(group.record)
                else:
                    self.metrics.count_late_member()
                continue
            hashes = options.hashes if options.round is not None else self._shared_at_a_shift(req, options, places)
            group = self.grouper.arrive(req, namespace_of(req), options.round, hashes, now)
            if group is not None and group.released:  # behind its released round's leader
                self.metrics.count_late_member()

    def _places(self, waiting_queue: list) -> dict[tuple, set[int]]:
        """Where each (namespace, segment hash) sits in the prompts waiting to be prefilled."""
        places: dict[tuple, set[int]] = {}
        for req in waiting_queue:
            if not req.output_ids:
                namespace = namespace_of(req)
                for span in self.options(req).spans:
                    places.setdefault((namespace, span.hash), set()).add(span.start)
        return places

    def _shared_at_a_shift(self, req, options: RequestOptions, places: dict[tuple, set[int]]) -> list[str]:
        """The segments of an unnamed request that make it a round member (inferred rounds): those
        another waiting prompt holds at another offset, or whose Master was computed at another
        offset -- what it would read, or be read for, at a shift. A segment only ever met at
        its own offset (a chat's history, a prompt sent again) is the tree's, exact: a request
        holding only such segments shares nothing and is never held."""
        if self.grouper.min_shared <= 0:
            return []
        namespace = namespace_of(req)
        return [span.hash for span in options.spans
                if places.get((namespace, span.hash), set()) - {span.start}
                or self.cached_at((namespace, span.hash)) not in (None, span.start)]

    def _prefilling_holder(self, req, options: RequestOptions) -> tuple[Any, Hashable, list[str]] | None:
        """(leader, namespace, hashes) when an admitted request still prefilling is computing at
        least `round_min_shared` segments, not cached yet, that an unnamed arrival holds at
        another offset (the one computing the most of them): the arrival waits for its Masters
        rather than compute the same blocks beside it. Inferred rounds otherwise form only
        among requests that reach the scheduler in the same pass."""
        if self.grouper.min_shared <= 0 or not self.grouper.lead or not self.prefilling:
            return None
        namespace = namespace_of(req)
        pending = [s for s in options.spans if self.cached_at((namespace, s.hash)) is None]
        best: tuple[Any, Hashable, list[str]] | None = None
        for other, other_options in self.prefilling.items():
            if namespace_of(other) != namespace:
                continue
            starts: dict[str, set[int]] = {}
            for span in other_options.spans:
                starts.setdefault(span.hash, set()).add(span.start)
            shared = [s.hash for s in pending if starts.get(s.hash, set()) - {s.start}]
            if len(shared) >= self.grouper.min_shared and (best is None or len(shared) > len(best[2])):
                best = (other, namespace, shared)
        return best

    def order(self, result, schedule_policy, waiting_queue: list, *unused, **unused_kw):
        """AFTER hook on SchedulePolicy.calc_priority: released groups stand together."""
        waiting_queue[:] = self.grouper.order(waiting_queue)
        return result

    def forget_aborted(self, result, scheduler, *unused, **unused_kw):
        """AFTER hook on Scheduler.abort_request."""
        self.grouper.keep_only(scheduler.waiting_queue)
        return result

    def add_stats(self, result, scheduler, *unused, **unused_kw):
        """AFTER hook on Scheduler.get_internal_state."""
        self.grouper.keep_only(scheduler.waiting_queue)
        result.internal_state["tokendance_rounds"] = self.grouper.stats()
        return result

    def leads(self, req) -> bool:
        """Whether SGLang is admitting `req` as its round's leader: its prompt is computed
        exactly and its blocks become their Masters (srt/forest)."""
        return self.grouper.leads(req)

    def round_of(self, req) -> RoundGroup | None:
        """The group of a request SGLang is admitting (None: no round)."""
        return self.grouper.group_of.get(req)

    def group_key(self, req) -> Hashable | None:
        """The key of the round group SGLang is admitting `req` with, or None: the blended
        prefill selects a group's shared segments together."""
        group = self.round_of(req)
        return None if group is None else group.key

    def register_hooks(self) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(f"{SCHEDULER}.get_new_batch_prefill", self.get_new_batch_prefill, HookType.AROUND)
        HookRegistry.register(f"{SCHEDULE_POLICY}.calc_priority", self.order, HookType.AFTER)
        HookRegistry.register(f"{SCHEDULER}.abort_request", self.forget_aborted, HookType.AFTER)
        HookRegistry.register(f"{SCHEDULER}.get_internal_state", self.add_stats, HookType.AFTER)


def prefilled(req) -> bool:
    """A leader's prefill is done once it produced its first token (or ended): its blocks are
    cached by then (the forest caches segments at each chunk's checkpoint)."""
    return req.finished() or len(req.output_ids) > 0


def _put_back(before: list, held: set[int], after: list) -> list:
    """The waiting queue after a pass: everything not admitted, in its order before the pass,
    then what SGLang queued during it (preempted requests)."""
    remaining = {id(r) for r in after} | held
    known = {id(r) for r in before}
    return [r for r in before if id(r) in remaining] + [r for r in after if id(r) not in known]


def _metrics_of(scheduler) -> RoundMetrics:
    """Our series beside the scheduler's own, with its labels, when SGLang collects metrics."""
    collector = scheduler.metrics_collector  # None unless --enable-metrics
    return NO_ROUND_METRICS if collector is None else PrometheusRoundMetrics(collector.labels)
