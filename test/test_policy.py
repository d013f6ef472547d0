"""The round-group policy's hooks (srt/policy.py) on a stand-in scheduler: fast, no server.
Live behaviour on a real scheduler: test_rounds_server.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_tokendance.core.collective import RoundTag
from sglang_tokendance.core.segments import SegmentError
from sglang_tokendance.server_args import TokenDanceArgs
from sglang_tokendance.srt.policy import RoundPolicy
from sglang_tokendance.srt.request import CARRIER_KEY, RequestOptions, RequestOptionsCache
from test_rounds_server import BAD_ROUNDS


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Req(SimpleNamespace):
    __hash__ = object.__hash__  # SGLang's Req is hashed by identity
    __eq__ = object.__eq__

    def finished(self) -> bool:
        return getattr(self, "done", False)


def req(name: str, round_id: str | None = None, size: int | None = None, hashes=(), output_ids=()):
    """`hashes`: segment hashes, each at offset 0, or (hash, offset) pairs."""
    placed = [h if isinstance(h, tuple) else (h, 0) for h in hashes]
    payload = {"segments": [{"start": at, "end": at + 1, "hash": h} for h, at in placed]}
    if round_id is not None:
        payload["round"] = round_id
    if size is not None:
        payload["round_size"] = size
    return Req(rid=name, sampling_params=SimpleNamespace(custom_params={CARRIER_KEY: json.dumps(payload)}),
                           output_ids=list(output_ids), extra_key=None, cache_salt=None)


class Scheduler:
    """What the policy touches of SGLang's Scheduler; `original` admits up to `budget`
    waiting requests in queue order, as SGLang's PrefillAdder would within its token budget."""

    def __init__(self, policy: RoundPolicy, budget: int = 100):
        self.policy, self.budget = policy, budget
        self.waiting_queue: list = []
        self.metrics_collector = None
        self.batches: list[list[str]] = []

    def original(self, scheduler, running_batch):
        self.policy.order(None, None, self.waiting_queue)  # SGLang's calc_priority, then our AFTER hook
        batch = self.waiting_queue[:self.budget]
        self.waiting_queue = self.waiting_queue[self.budget:]
        self.batches.append([r.rid for r in batch])
        groups = [self.policy.round_of(r) for r in batch]  # as SGLang's prepare_for_extend sees them
        self.groups = [None if g is None else [m.rid for m in g.members] for g in groups]
        return SimpleNamespace(batch_to_run=SimpleNamespace(reqs=batch) if batch else None)

    def schedule(self) -> list[str]:
        self.policy.get_new_batch_prefill(self.original, self, "running batch")
        return self.batches[-1]


def setup(window_ms: float = 100.0, min_shared: int | None = 0, budget: int = 100, leader: bool = False):
    """`min_shared` None: the server's default."""
    clock = Clock()
    inferred = {} if min_shared is None else {"round_min_shared": min_shared}
    args = TokenDanceArgs(round_window_ms=window_ms, round_leader=leader, **inferred)
    policy = RoundPolicy(args, RequestOptionsCache(), clock=clock)
    return clock, Scheduler(policy, budget)


def test_staggered_round_is_admitted_in_one_batch_and_plain_requests_pass():
    clock, sched = setup()
    a, b, c, plain = req("a", "r", 3), req("b", "r", 3), req("c", "r", 3), req("plain")
    sched.waiting_queue += [a, plain]
    assert sched.schedule() == ["plain"]
    clock.now = 0.03
    sched.waiting_queue.append(b)
    assert sched.schedule() == [] and [r.rid for r in sched.waiting_queue] == ["a", "b"]
    clock.now = 0.05
    sched.waiting_queue += [req("late-plain"), c]
    assert sched.schedule() == ["a", "b", "c", "late-plain"]  # the round stands where a stood
    assert sched.groups == [["a", "b", "c"]] * 3 + [None]  # what the blended prefill can read
    stats = sched.policy.grouper.stats()
    assert stats["largest_group_admitted"] == 3 and stats["rounds_formed"] == 1 and stats["fallbacks"] == 0
    assert stats["wait_added_s"] == pytest.approx(0.05 + 0.02) and stats["tracked_requests"] == 0


def test_led_round_admits_its_leader_alone_then_the_others_after_its_first_token():
    clock, sched = setup(leader=True)
    a, b, c = req("a", "r", 3, hashes=["x"]), req("b", "r", 3, hashes=["x", "y"]), req("c", "r", 3, hashes=["x"])
    sched.waiting_queue += [a, b, c, req("plain")]
    leads = []
    sched.original = lambda scheduler, running: (leads.append([r.rid for r in sched.waiting_queue
                                                               if sched.policy.leads(r)]),
                                                 Scheduler.original(sched, scheduler, running))[1]
    assert sched.schedule() == ["b", "plain"] and leads[-1] == ["b"]  # b holds the most blocks
    assert sched.schedule() == [] and [r.rid for r in sched.waiting_queue] == ["a", "c"]
    b.output_ids.append(7)  # its prefill is done
    assert sched.schedule() == ["a", "c"] and leads[-1] == []
    stats = sched.policy.grouper.stats()
    assert stats["led_rounds"] == 1 and stats["tracked_requests"] == 0


def test_led_round_goes_on_when_its_leader_ends_or_is_aborted():
    clock, sched = setup(leader=True)
    lead, follower = req("a", "r", 2), req("b", "r", 2)
    sched.waiting_queue += [lead, follower]
    assert sched.schedule() == ["a"]
    lead.done = True  # e.g. aborted while running, before its first token
    assert sched.schedule() == ["b"]
    lead, follower = req("c", "s", 2), req("d", "s", 2)
    sched.waiting_queue += [lead, follower]
    sched.budget = 0  # nothing admitted: the leader waits in the queue
    assert sched.schedule() == []
    sched.waiting_queue.remove(lead)  # aborted in the queue
    sched.policy.forget_aborted(None, sched)
    sched.budget = 100
    assert sched.schedule() == ["d"]


def test_a_member_behind_its_rounds_leader_is_counted_in_the_metrics_as_in_the_stats():
    from sglang_tokendance.srt.metrics import RoundMetrics

    class Recorder(RoundMetrics):
        members = 0

        def count_round(self, record) -> None:
            self.members += record.members

        def count_late_member(self) -> None:
            self.members += 1

    clock, sched = setup(window_ms=100, leader=True)
    sched.policy.metrics = recorder = Recorder()
    sched.waiting_queue += [req("a", "r", 3, hashes=["x", "y"]), req("b", "r", 3, hashes=["x"])]
    assert sched.schedule() == []
    clock.now = 0.1  # the window expired: released short, its leader first
    assert sched.schedule() == ["a"]
    sched.waiting_queue.append(req("c", "r", 3, hashes=["x"]))  # late, behind the leader still prefilling
    assert sched.schedule() == [] and recorder.members == 3
    assert sched.policy.grouper.stats()["mean_group_size"] == 3


def test_released_group_stands_together_where_its_first_member_stood():
    clock, sched = setup()
    sched.waiting_queue += [req("a", "r", 2), req("p1"), req("p2")]
    assert sched.schedule() == ["p1", "p2"]
    sched.waiting_queue += [req("p3"), req("b", "r", 2)]
    assert sched.schedule() == ["a", "b", "p3"]


def test_budget_split_round_keeps_the_rest_released():
    clock, sched = setup(budget=2)
    sched.waiting_queue += [req(n, "r", 3) for n in "abc"]
    assert sched.schedule() == ["a", "b"]
    assert sched.schedule() == ["c"]
    assert sched.policy.grouper.recent[-1].admitted == [2, 1]


def test_missing_member_costs_the_window():
    clock, sched = setup(window_ms=100)
    sched.waiting_queue += [req("a", "r", 3), req("b", "r", 3)]
    assert sched.schedule() == []
    clock.now = 0.099
    assert sched.schedule() == []
    clock.now = 0.1
    assert sched.schedule() == ["a", "b"]
    assert sched.policy.grouper.stats()["fallbacks"] == 1


def test_aborted_held_member_is_forgotten():
    clock, sched = setup()
    a, b = req("a", "r", 3), req("b", "r", 3)
    sched.waiting_queue += [a, b]
    sched.schedule()
    sched.waiting_queue.remove(a)  # SGLang's abort pops it from the waiting queue
    sched.policy.forget_aborted(None, sched)
    assert sched.policy.grouper.stats()["held_requests"] == 1
    sched.waiting_queue.remove(b)
    sched.policy.forget_aborted(None, sched)
    stats = sched.policy.grouper.stats()
    assert stats["tracked_requests"] == 0 and stats["open_rounds"] == 0


def test_retracted_request_is_never_held_and_inferred_rounds_group_overlaps():
    clock, sched = setup(min_shared=2)
    sched.waiting_queue += [req("retracted", "r", 2, output_ids=[5]), req("x", hashes=[("h1", 3), ("h2", 9)]),
                            req("y", hashes=[("h2", 5), ("h1", 20), ("h3", 40)]), req("z", hashes=[("h9", 4)])]
    assert sched.schedule() == ["retracted", "z"]
    clock.now = 0.1
    assert sched.schedule() == ["x", "y"]


def test_inferred_rounds_count_only_segments_shared_at_a_shift():
    """A chat's history (the same messages at the same offsets in every prompt, or cached where
    they sit) shares nothing at a shift: never held. A prompt holding a block cached at another
    offset is held though it arrives alone, and the prompts reading it with it form its round."""
    clock, sched = setup(min_shared=None)
    assert sched.policy.grouper.min_shared == 1  # the default infers rounds
    sched.policy.cached_at = {((None, None), "doc"): 7, ((None, None), "history"): 0}.get
    sched.waiting_queue += [req("chat-1", hashes=[("history", 0), ("sys", 0)]),
                            req("chat-2", hashes=[("history", 0), ("sys", 0)])]
    assert sched.schedule() == ["chat-1", "chat-2"]
    sched.waiting_queue.append(req("reader", hashes=[("history", 0), ("doc", 30)]))
    assert sched.schedule() == []  # held: it reads "doc" at a shift
    clock.now = 0.05
    sched.waiting_queue.append(req("peer", hashes=[("doc", 12)]))
    assert sched.schedule() == []
    clock.now = 0.2
    assert sched.schedule() == ["reader", "peer"] and sched.groups == [["reader", "peer"]] * 2


def test_an_arrival_waits_for_a_prefilling_request_computing_its_blocks_at_another_offset():
    """Round 0 of an unmodified client: nothing cached, its requests reaching the scheduler a
    pass apart. The first shares nothing yet and is admitted; a later one holding its blocks at
    another offset waits for its prefill (those of later passes with it), then reads them from
    their Masters. One holding them at the same offset (its own history) does not wait."""
    clock, sched = setup(min_shared=None, leader=True)
    first = req("first", hashes=[("t1", 10), ("t2", 40)])
    sched.waiting_queue.append(first)
    assert sched.schedule() == ["first"]
    sched.waiting_queue.append(req("history", hashes=[("t1", 10)]))
    assert sched.schedule() == ["history"]
    sched.waiting_queue.append(req("second", hashes=[("t1", 25), ("t2", 55)]))
    assert sched.schedule() == []
    clock.now = 0.5  # past the window: it waits for the prefill, not the window
    sched.waiting_queue.append(req("third", hashes=[("t2", 70)]))
    assert sched.schedule() == []
    first.output_ids.append(3)  # its prefill is done: its blocks are cached
    assert sched.schedule() == ["second", "third"] and sched.groups == [["second", "third"]] * 2
    stats = sched.policy.grouper.stats()
    assert (stats["rounds_formed"], stats["led_rounds"], stats["mean_group_size"]) == (1, 1, 3.0)
    assert stats["tracked_requests"] == 0 and stats["wait_added_s"] == pytest.approx(0.5)

    clock, sched = setup(min_shared=None, leader=False)  # --no-tokendance-round-leader: nobody waits for one
    sched.waiting_queue.append(req("first", hashes=[("t1", 10)]))
    assert sched.schedule() == ["first"]
    sched.waiting_queue.append(req("second", hashes=[("t1", 25)]))
    assert sched.schedule() == ["second"]


def test_request_options_are_validated_and_carried_as_one_object():
    def client(options, mirror=False) -> dict:
        return RequestOptions.from_client(options, mirror).payload()

    assert client({"round": "r", "round_size": 2, "register_output": False}) == {"segments": [], "round": "r",
                                                                               "round_size": 2}
    assert client({"round": "r"}) == {"segments": [], "round": "r"} and client(None) == {"segments": []}
    assert client({"agent": "alice"}, True) == {"segments": [], "agent": "alice"}
    assert client({"max_approximate_tokens": 0}) == {"segments": [], "max_approximate_tokens": 0}
    for budget in (-1, 2.5, "10", True):
        with pytest.raises(SegmentError, match="max_approximate_tokens. must be an integer >= 0"):
            RequestOptions.from_client({"max_approximate_tokens": budget}, False)
    for options, message in BAD_ROUNDS:
        with pytest.raises(SegmentError, match=message.replace("`", ".")):
            RequestOptions.from_client(options, True)
    with pytest.raises(SegmentError, match="needs --tokendance-storage mirror"):
        RequestOptions.from_client({"agent": "alice"}, False)
    carried = RequestOptions.from_client({"round": "r", "round_size": 3, "register_output": True, "agent": "a",
                                          "max_approximate_tokens": 40}, True)
    assert RequestOptions.from_payload(carried.payload()) == carried  # the scheduler reads what was sent
    assert carried.round == RoundTag("r", 3) and carried.register_output and carried.agent == "a"
    assert carried.max_approximate_tokens == 40
    cache, req = RequestOptionsCache(), Req(rid="x", sampling_params=SimpleNamespace(
        custom_params={CARRIER_KEY: json.dumps(carried.payload())}))
    assert cache(req) is cache(req) == carried  # parsed once per request
