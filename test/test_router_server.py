"""TokenDance workers behind SGLang's own router (sglang-router 0.3.2): a simulation routed by
one key stays on one worker and keeps a single worker's reuse; keys spread simulations over the
workers; round-robin routing scatters a round and loses reuse (shown, not hidden); a worker
lost mid-round costs no request. A tiny random Llama: what is tested is where requests go and
what they hit, not what they say. The options ride as JSON text in `custom_labels`, which the
router keeps (it drops a top-level `tokendance` on /generate)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import assert_no_leak
from test_readme_examples import run_example
from sglang_tokendance.bench.router_process import RouterProcess
from sglang_tokendance.bench.server_process import ServerProcess, flush_cache
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from sglang_tokendance.routing import ROUTING_HEADER, options_label

pytestmark = pytest.mark.slow

AGENTS = 4
WORDS = "mill river bakery market council bridge square lantern orchard meadow forge granary".split()


def statement(simulation: str, round_index: int, agent: int, words: int = 40) -> str:
    """What `agent` said in a round: a shared block of every prompt of the next round."""
    seed = sum(map(ord, simulation)) + 7 * round_index + 13 * agent
    return f"{simulation}, agent {agent}, round {round_index}: " + " ".join(WORDS[(seed + k * 5) % len(WORDS)]
                                                               for k in range(words)) + "."


def prompt(simulation: str, round_index: int, agent: int) -> str:
    """All-Gather: the agent's private notes, then every agent's last statement (rotated)."""
    said = [statement(simulation, round_index, (agent + j) % AGENTS) for j in range(AGENTS)]
    return SEP.join([f"You are agent {agent} of {simulation}. Your notes: day {round_index}.", *said,
                     " What do you say?"])


def generate(url: str, text: str, key: str | None, options: dict | None = None, new_tokens: int = 4) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    if options:
        body["custom_labels"] = options_label(options)
    headers = {ROUTING_HEADER: key} if key else {}
    response = requests.post(url + "/generate", json=body, headers=headers, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["meta_info"]["tokendance"]


def play_round(url: str, simulation: str, round_index: int, key: str | None, new_tokens: int = 4) -> list[dict]:
    """One round: every agent's request at once, named as one round of AGENTS."""
    options = {"round": f"{simulation}/{round_index}", "round_size": AGENTS}
    with ThreadPoolExecutor(AGENTS) as pool:
        return list(pool.map(lambda a: generate(url, prompt(simulation, round_index, a), key, options, new_tokens),
                             range(AGENTS)))


def reuse_of(rounds: list[list[dict]]) -> list[tuple[int, int, int]]:
    """Per round: segment hits, tokens taken from the cache (kept or recomputed), leader tokens."""
    return [(sum(m["segment_hits"] for m in members),
             sum(m["reused_tokens"] + m["recomputed_tokens"] for m in members),
             sum(m["round_master_tokens"] for m in members)) for members in rounds]


def counts(worker: ServerProcess) -> tuple[int, int]:
    """(rounds formed, segments cached) on one worker."""
    info = requests.get(worker.url + "/server_info", timeout=60).json()["internal_states"][0]
    return info["tokendance_rounds"]["rounds_formed"], info["tokendance_forest"]["segments_inserted"]


@pytest.fixture(scope="module")
def workers(tiny_llama):
    """Two TokenDance workers with their default flags, started together."""
    procs = [ServerProcess(["--model-path", tiny_llama, "--context-length", "2048"]) for _ in range(2)]
    try:
        yield [proc.wait_ready() for proc in procs]
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def manual_router(workers):
    with RouterProcess([w.url for w in workers], policy="manual") as router:
        yield router


@pytest.fixture
def emptied(workers):
    """Both workers emptied before the test, and leak-free after it."""
    for worker in workers:
        flush_cache(worker.url)
    yield workers
    for worker in workers:
        if worker.proc.poll() is None:
            assert_no_leak(worker.url)


def test_a_keyed_simulation_stays_on_one_worker_with_a_single_workers_reuse(manual_router, emptied):
    before = [counts(w) for w in emptied]
    routed = [play_round(manual_router.url, "sim-a", r, key="sim-a") for r in range(2)]
    grown = [tuple(a - b for a, b in zip(counts(w), old)) for w, old in zip(emptied, before)]
    home = next(i for i, g in enumerate(grown) if g != (0, 0))
    assert grown[1 - home] == (0, 0)  # the other worker saw nothing of it
    assert grown[home][0] == 2  # both rounds formed whole on one worker
    # the round options arrived: each round went leader first (alone, exact), then every other
    # member hit every block the leader had cached, even in round 0 with nothing cached before
    assert [r[0] for r in reuse_of(routed)] == [(AGENTS - 1) * AGENTS] * 2
    # the same simulation on one worker alone, without the router: the same reuse
    for worker in emptied:
        flush_cache(worker.url)
    alone = [play_round(emptied[1 - home].url, "sim-a", r, key=None) for r in range(2)]
    assert reuse_of(routed) == reuse_of(alone)


def test_keys_spread_simulations_over_the_workers_and_stick(manual_router, emptied):
    keys = [f"sim-{i}" for i in range(16)]  # all on one worker by chance: 2 in 2**16
    before = [counts(w)[1] for w in emptied]
    first = [generate(manual_router.url, prompt(key, 0, 0), key) for key in keys]
    cached = [counts(w)[1] - old for w, old in zip(emptied, before)]
    assert all(c > 0 for c in cached) and sum(cached) == AGENTS * len(keys)
    assert all(m["segment_hits"] == 0 for m in first)
    again = [generate(manual_router.url, prompt(key, 0, 1), key) for key in keys]  # same blocks, rotated
    assert all(m["segment_hits"] == AGENTS for m in again)  # each key went back to its worker
    for key in keys[:2]:  # OpenAI chat: the same key, the options as JSON text in `metadata`
        chat = requests.post(manual_router.url + "/v1/chat/completions", headers={ROUTING_HEADER: key}, json={
            "model": "m", "max_tokens": 2, "metadata": options_label({"round": key}),
            "messages": [{"role": "user", "content": prompt(key, 0, 2)}]}, timeout=300)
        assert chat.status_code == 200, chat.text
        info = chat.json()["metadata"]["tokendance"]
        assert info["round"] == key and info["segment_hits"] == AGENTS


def test_round_robin_scatters_a_round_and_loses_reuse(workers, manual_router, emptied):
    keyed = [play_round(manual_router.url, "sim-b", r, key="sim-b") for r in range(2)]
    for worker in emptied:
        flush_cache(worker.url)
    before = [counts(w)[1] for w in emptied]
    with RouterProcess([w.url for w in workers], policy="round_robin") as router:
        scattered = [play_round(router.url, "sim-b", r, key="sim-b") for r in range(2)]
    assert all(counts(w)[1] > old for w, old in zip(emptied, before))  # both workers cached the blocks
    assert sum(r[0] for r in reuse_of(scattered)) < sum(r[0] for r in reuse_of(keyed))


def test_the_readmes_router_example_prints_the_hits_it_promises(manual_router, emptied):
    """README, "Serve your own app" (d): two agents with one routing key reach one worker, and the
    second hits the two blocks the first cached there."""
    assert [hits for hits, _ in run_example("router", manual_router.url)] == [0, 2]


def test_a_worker_lost_mid_round_costs_no_request(manual_router, emptied):
    """Last in the module: it kills a worker. The router's retry sends the lost worker's requests
    to the other, which recomputes what it misses; the simulation goes on there."""
    before = [counts(w) for w in emptied]
    play_round(manual_router.url, "sim-c", 0, key="sim-c")
    home = next(i for i, w in enumerate(emptied) if counts(w) != before[i])
    survivor, cached = emptied[1 - home], counts(emptied[1 - home])
    answers: list[list[dict]] = []
    round_1 = threading.Thread(target=lambda: answers.append(
        play_round(manual_router.url, "sim-c", 1, "sim-c", new_tokens=512)))  # seconds of decoding
    round_1.start()
    time.sleep(1.0)  # the round is decoding on its worker
    emptied[home].stop()
    round_1.join(timeout=600)
    assert len(answers) == 1 and len(answers[0]) == AGENTS  # every request answered (200)
    assert counts(survivor)[1] > cached[1]  # ... by the survivor, which computed the round's blocks
    round_2 = play_round(manual_router.url, "sim-c", 2, key="sim-c")  # the simulation goes on
    assert sum(m["segment_hits"] for m in round_2) == (AGENTS - 1) * AGENTS
