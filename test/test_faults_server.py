"""Faults with reuse active (a tiny random Llama: the model does not matter, a KV pool far
below the working set does): client
disconnects, SGLang retracting reusing requests under pool pressure, /flush_cache while
reusing requests run, and many agents on a tiny pool. After each: the leak invariant
(conftest, after every test) and a good request answered correctly.

The server recomputes every reused token (ratio 1): requests still hit segments, restore
them, probe and select, but their answers must equal a full prefill's exactly, so a fault
that corrupts KV shows as a changed answer."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import forest_stats, generate, stream_chunks
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from sglang_tokendance.bench.server_process import ServerProcess

pytestmark = pytest.mark.slow

WORDS = "mill river bakery market council bridge square lantern orchard meadow forge granary".split()
POOL = 2048
# SGLang's own retraction test switch: every 30th decode step retracts requests
RETRACT_EVERY_30_STEPS = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "30"}


def block(i: int, words: int = 100) -> str:
    return f"Message {i}: " + " ".join(WORDS[(i * 5 + k * 7) % len(WORDS)] for k in range(words)) + "."


BLOCKS = [block(i) for i in range(8)]


def agent_prompt(agent: int, blocks: int = 3) -> str:
    chosen = [BLOCKS[(agent + j) % len(BLOCKS)] for j in range(blocks)]
    return SEP.join([f"You are agent {agent}, who keeps the {WORDS[agent % len(WORDS)]}.", *chosen, " Reply:"])


def post(url: str, text: str, max_new_tokens: int = 4, **sampling) -> dict:
    return generate(url, text, max_new_tokens, sampling)


@pytest.fixture(scope="module")
def server(tiny_llama):
    # retraction every 30 decode steps on top of the real pressure of a tiny pool: every
    # concurrent run below is retracted and re-run; the same prompts are sent again on purpose, to
    # reuse again (not to be computed as recurrences, core/recurrence), and blended at ratio 1 (where
    # SGLang's own forward would be cheaper: core/cost)
    with ServerProcess(["--model-path", tiny_llama, "--max-total-tokens", str(POOL), "--context-length", "1024",
                        "--tokendance-recompute-ratio", "1.0", "--tokendance-check-layer", "2",
                        "--no-tokendance-exact-recurrence", "--no-tokendance-cost-check"],
                       env=RETRACT_EVERY_30_STEPS) as proc:
        for author in range(2):  # every block cached, in two authors' contexts
            post(proc.url, SEP.join([f"You are author {author}.", *BLOCKS[author * 4:author * 4 + 4], " Go:"]), 1)
        assert forest_stats(proc.url)["segment_nodes"] == len(BLOCKS)
        yield proc.url


@pytest.fixture(scope="module")
def clean(server):
    """Answers on an idle server, one request at a time (reuse active, no pressure)."""
    outs = [post(server, agent_prompt(agent, 2), 64, ignore_eos=True) for agent in range(6)]
    assert sum(out["meta_info"]["tokendance"]["segment_hits"] for out in outs) >= 6  # the pool holds a few blocks
    return [out["output_ids"] for out in outs]


def test_retracted_reusing_requests_rerun_to_the_clean_answer(server, clean):
    with ThreadPoolExecutor(6) as pool:  # retracted every 30 decode steps (and short of KV)
        outs = list(pool.map(lambda a: post(server, agent_prompt(a, 2), 64, ignore_eos=True), range(6)))
    assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0, "the pool was not under pressure"
    assert sum(o["meta_info"]["tokendance"]["segment_hits"] for o in outs) > 0
    for agent, out in enumerate(outs):
        assert out["output_ids"] == clean[agent], agent


def stream(url: str, body: dict):
    response = requests.post(url + "/generate", json={**body, "stream": True}, stream=True, timeout=900)
    response.raise_for_status()
    return response, stream_chunks(response)


def test_client_disconnects_mid_decode_and_flush_waits_for_running_requests(server, clean):
    body = {"text": agent_prompt(0, 2), "sampling_params": {"max_new_tokens": 200, "temperature": 0,
                                                              "ignore_eos": True}}
    response, chunks = stream(server, body)
    next(chunks)  # prefill done, decoding
    refused = requests.post(server + "/flush_cache", timeout=60)
    assert refused.status_code != 200 and forest_stats(server)["segment_nodes"] > 0  # SGLang refuses: requests run
    response.close()  # the client goes away mid-decode
    for _ in range(3):  # and mid-prefill: gone before the first token
        response, _ = stream(server, {**body, "text": agent_prompt(3, 3)})
        response.close()
    assert post(server, agent_prompt(1, 2), 64, ignore_eos=True)["output_ids"] == clean[1]


def test_many_agents_on_a_tiny_pool_all_finish_and_segments_come_back(server, clean):
    before = forest_stats(server)
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda a: post(server, agent_prompt(a, 3), 4), range(32)))
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    hits = sum(o["meta_info"]["tokendance"]["segment_hits"] for o in outs)
    after = forest_stats(server)
    assert hits > 0 and after["segments_evicted"] > before["segments_evicted"]
    assert after["segments_inserted"] > before["segments_inserted"]  # evicted segments are cached again
    assert post(server, agent_prompt(2, 2), 64, ignore_eos=True)["output_ids"] == clean[2]


def group_processes(pgid: int) -> list[tuple[int, str]]:
    """(pid, state) of every process, zombies included, in the process group `pgid`."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                found.append((int(entry), fields[0]))
    return found


def test_sigterm_during_a_round_drains_it_and_ends_every_process(tiny_llama):
    """SGLang's graceful shutdown: on SIGTERM it refuses new work, lets the requests in flight
    finish (the whole round streams to the end), then stops every process it started."""
    import os
    import signal

    tokens = 160  # still decoding when the signal comes, even on a tiny model
    # blocks read wherever cached, whatever order the agents arrive in: a round inferred without
    # the agent whose prompt was cached first once read nothing (its leader computed, two members
    # computed in full); the drain, not the reuse rules, is what this test is about
    server = ServerProcess(["--model-path", tiny_llama, "--tokendance-round-min-shared", "0",
                            "--no-tokendance-cost-check"]).wait_ready()
    try:
        post(server.url, agent_prompt(0, 2), 1)  # cache blocks: the round below reuses them
        results: list = []
        started = [threading.Event() for _ in range(4)]

        def agent(a: int) -> None:
            try:
                response, chunks = stream(server.url, {"text": agent_prompt(a, 2), "sampling_params": {
                    "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}})
                last = next(chunks)
                started[a].set()
                for last in chunks:
                    pass
                results.append(("streamed", last["meta_info"]["completion_tokens"],
                                last["meta_info"]["tokendance"]["segment_hits"]))
            except (requests.RequestException, ValueError, StopIteration) as e:
                results.append(("failed", type(e).__name__))
            finally:
                started[a].set()

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(agent, a) for a in range(4)]
            assert all(event.wait(600) for event in started)  # every agent's request is in flight
            os.kill(server.proc.pid, signal.SIGTERM)
            server.proc.wait(timeout=900)  # drained, then exited (a hang fails here)
            for f in futures:
                f.result(timeout=60)  # no client hangs
        assert sorted(results)[0][:2] == ("streamed", tokens) and len({r[:2] for r in results}) == 1, results
        assert sum(r[2] for r in results) > 0  # the round reused cached segments
        deadline = time.monotonic() + 60
        while group_processes(server.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert group_processes(server.proc.pid) == [], "scheduler or detokenizer left behind"
    finally:
        server.stop()


def test_a_server_whose_chosen_port_another_process_bound_starts_on_another(tiny_llama, monkeypatch):
    """free_port() only finds a port free: something may bind it before the server does (SGLang
    then stays up without serving). The server starts again on another port, at once, not
    after the readiness timeout."""
    import socket

    from sglang_tokendance.bench import server_process

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports, free_port = iter([taken]), server_process.free_port
    monkeypatch.setattr(server_process, "free_port", lambda: next(ports, None) or free_port())
    try:
        with ServerProcess(["--model-path", tiny_llama]) as server:
            assert server.port != taken and requests.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        squatter.close()

