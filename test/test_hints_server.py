"""Clients' hints on what a finished request's KV is worth (pin, retain, release) through a
real server: carried from the request body to the release, a pin holding its prefix through
a flood larger than the pool (SGLang's own pool check counting it as protected) until its
deadline, a pin past the budget taken as a retain, bad hints refused with 400
(conftest's leak invariant after every test: the only tree locks left are the pins)."""

from __future__ import annotations

import random
import time

import pytest
import requests

from conftest import forest_stats, generate
from sglang_tokendance.bench.server_process import ServerProcess

pytestmark = pytest.mark.slow

POOL = 1024
WORDS = "ember quarry willow harbor signal meadow copper lantern thistle beacon cobalt juniper".split()


def text(i: int, words: int = 150) -> str:
    """A prompt sharing no text with any other i (so nothing reads another's KV)."""
    pick = random.Random(i).choice
    return f"Note {i}: " + " ".join(pick(WORDS) for _ in range(words)) + "."


def cached(url: str, prompt: str, **tokendance) -> tuple[int, int]:
    """(cached tokens, prompt tokens) of one greedy token."""
    info = generate(url, prompt, 1, **({"tokendance": tokendance} if tokendance else {}))["meta_info"]
    return info["cached_tokens"], info["prompt_tokens"]


def flood(url: str, first: int) -> None:
    """Unique prompts of more tokens than the pool holds, one at a time."""
    for i in range(first, first + 8):
        cached(url, text(i))


@pytest.fixture(scope="module")
def server(tiny_llama):
    with ServerProcess(["--model-path", tiny_llama, "--max-total-tokens", str(POOL), "--context-length", "512",
                        "--tokendance-max-hint-seconds", "30"],
                       env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"}) as proc:
        yield proc.url


def test_a_pinned_prefix_survives_a_flood_until_its_deadline_and_a_plain_one_does_not(server):
    pinned, plain = text(1000), text(2000)
    start = time.monotonic()
    _, length = cached(server, pinned, pin_seconds=12)
    cached(server, plain)
    stats = forest_stats(server)
    assert stats["hint_pins"] == 1 and 0 < stats["hint_pinned_tokens"] <= length
    assert stats["tree_protected_tokens"] == stats["hint_pinned_tokens"]  # SGLang's lock, counted by its pool check
    flood(server, 0)
    assert cached(server, pinned)[0] >= length - 1  # its whole prefix is still cached
    assert cached(server, plain)[0] < length // 2  # evicted by the flood (recency)
    time.sleep(max(0.0, start + 12.5 - time.monotonic()))
    assert forest_stats(server)["hint_pins"] == 0 == forest_stats(server)["tree_protected_tokens"]
    flood(server, 100)
    assert cached(server, pinned)[0] < length // 2  # the pin ended: SGLang's order again


def test_a_pin_past_the_budget_is_a_retain(server):
    """The budget is a quarter of the pool (--tokendance-max-pinned-share 0.25): 256 tokens."""
    clipped = forest_stats(server)["hint_pins_clipped"]
    _, first = cached(server, text(3000, 180), pin_seconds=2)
    cached(server, text(3001, 180), pin_seconds=2)
    stats = forest_stats(server)
    assert stats["hint_pins"] == 1 and stats["hint_pins_clipped"] == clipped + 1 and first + 200 > POOL // 4
    time.sleep(2.5)


def test_the_request_that_ends_a_simulation_sends_what_its_requests_left_first(server):
    """Before, recency evicted the oldest prompt (another simulation's) first; now the ended
    simulation's prompts go first, though they were read last."""
    from sglang_tokendance.bench.server_process import flush_cache

    flush_cache(server)
    _, length = cached(server, text(4000), simulation="s2")  # the oldest, another simulation's
    cached(server, text(4001), simulation="s1")
    cached(server, text(4002), simulation="s1", end_simulation=True)
    assert forest_stats(server)["simulations_ended"] >= 1
    for i in range(4003, 4006):
        cached(server, text(i))  # 6 x ~195 tokens > 1024: the pool evicts
    assert cached(server, text(4000))[0] >= length - 1  # s2's prompt kept
    assert min(cached(server, text(4001))[0], cached(server, text(4002))[0]) < length // 2


@pytest.mark.parametrize("tokendance, message", [
    ({"pin_seconds": 31}, "--tokendance-max-hint-seconds"),
    ({"pin_seconds": 5, "release": True}, "at most one"),
    ({"retain_seconds": "soon"}, "retain_seconds"),
    ({"release": 1}, "release"),
    ({"end_simulation": True}, "needs `tokendance.simulation`"),
])
def test_bad_hints_are_refused_with_400(server, tokendance, message):
    r = requests.post(server + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 1},
                                                  "tokendance": tokendance}, timeout=60)
    assert r.status_code == 400 and message in r.text, r.text
    r = requests.post(server + "/v1/chat/completions", timeout=60, json={
        "model": "default", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1,
        "tokendance": tokendance})
    assert r.status_code == 400 and message in r.text, r.text
