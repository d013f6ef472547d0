"""Round groups on a live scheduler (tiny random-weight Llama): a round's staggered requests
are admitted in one prefill batch, plain requests are not delayed by a held round, a missing
member costs only the window, an aborted held member leaves no state, overlapping requests
form inferred rounds, and the round fields reach the scheduler from /generate, the OpenAI API
and the frontend language. A round's members that read the same cached blocks in one batch
run the collective blended prefill (aligned selection, one member probing). Bad round fields
are 400s. After each: the leak invariant. This server admits a round all at once
(--no-tokendance-round-leader); the leader's two steps on a live server:
test_quality_server_live.py."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import generate
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from sglang_tokendance.bench.server_process import ServerProcess, flush_cache
from sglang_tokendance.bench.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow

WINDOW_MS = 10_000  # generous: no member below is expected to wait for it unless the test says so
BLOCK_A = "Tom: The river flooded the old mill last night, so the north road is closed until Friday."
BLOCK_B = "Ada: The council will vote on the new market hall tomorrow at noon in the town square."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    with ServerProcess(["--model-path", str(path), "--tokendance-storage", "dense",  # `agent` a 400: below
                        "--tokendance-round-window-ms", str(WINDOW_MS),
                        "--tokendance-round-min-shared", "2", "--tokendance-check-layer", "2",
                        "--tokendance-group-selection", "aligned", "--tokendance-group-probe", "1",
                        "--enable-metrics", "--no-tokendance-exact-recurrence",  # rounds sent again reuse
                        "--no-tokendance-round-leader"]) as proc:
        yield proc.url


def rounds_stats(url: str) -> dict:
    info = requests.get(url + "/server_info", timeout=60).json()
    return info["internal_states"][0]["tokendance_rounds"]


def record_of(url: str, round_id: str) -> dict:
    [record] = [r for r in rounds_stats(url)["recent_rounds"] if r["round_id"] == round_id]
    return record


def wait_until(condition, timeout: float = 120.0) -> None:
    """Poll until `condition()` holds (a behaviour, not a timing: the bound only ends a hang)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.1)


class Sent(threading.Thread):
    """One /generate request in flight."""

    def __init__(self, url: str, text: str, **extra):
        super().__init__(daemon=True)
        self.url, self.text, self.extra, self.result = url, text, extra, None
        self.start()

    def run(self) -> None:
        body = {"text": self.text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **self.extra}
        self.result = requests.post(self.url + "/generate", json=body, timeout=600)


def member(url: str, round_id: str, size: int | None, i: int, **extra) -> Sent:
    options = {"round": round_id} if size is None else {"round": round_id, "round_size": size}
    return Sent(url, f"Agent {i} of {round_id} says hello to the others.", tokendance=options, **extra)


def test_staggered_round_is_admitted_in_one_prefill_batch(server):
    size = 4
    sent = []
    for i in range(size):
        sent.append(member(server, "stagger", size, i))
        if i < size - 1:  # each member reaches the scheduler before the next is sent
            wait_until(lambda: rounds_stats(server)["held_requests"] == i + 1)
    for s in sent:
        s.join()
        assert s.result.status_code == 200, s.result.text
    record = record_of(server, "stagger")
    assert record["members"] == size and not record["fallback"] and record["admitted"] == [size]
    assert rounds_stats(server)["largest_group_admitted"] >= size


def test_plain_request_is_not_delayed_by_a_pending_round(server):
    held = member(server, "pending", 2, 0)
    wait_until(lambda: rounds_stats(server)["held_requests"] == 1)
    generate(server, "A plain request with no round.", 4)
    assert rounds_stats(server)["held_requests"] == 1  # answered while the round was still held
    last = member(server, "pending", 2, 1)
    for s in (held, last):
        s.join()
        assert s.result.status_code == 200
    assert record_of(server, "pending")["admitted"] == [2]


def test_round_whose_last_member_never_arrives_is_admitted_after_the_window(server):
    before = rounds_stats(server)["fallbacks"]
    sent = [member(server, "short", 3, i) for i in range(2)]
    for s in sent:
        s.join()
        assert s.result.status_code == 200
    record = record_of(server, "short")
    assert record["fallback"] and record["members"] == 2 and record["wait_s"] > 0
    assert rounds_stats(server)["fallbacks"] == before + 1


def test_aborted_held_member_leaves_no_state(server):
    held = member(server, "aborted", 2, 0, rid="held-member")
    wait_until(lambda: rounds_stats(server)["held_requests"] == 1)
    requests.post(server + "/abort_request", json={"rid": "held-member"}, timeout=60)
    held.join()
    wait_until(lambda: rounds_stats(server)["tracked_requests"] == 0)
    stats = rounds_stats(server)
    assert stats["open_rounds"] == 0 and stats["held_requests"] == 0
    assert not [r for r in stats["recent_rounds"] if r["round_id"] == "aborted"]


def test_overlapping_requests_form_an_inferred_round(server):
    """Nothing cached: a prompt arriving alone shares nothing at a shift and passes at once (its
    blocks become Masters); the next prompts, holding them at other offsets, form a round. The
    same prompt sent again holds its blocks where they were computed: never held."""
    flush_cache(server)
    before = rounds_stats(server)
    seed = SEP.join(["Notes of the scribe, written at dawn in the old mill by the river, for the council.", BLOCK_A,
                     BLOCK_B, " Go on."])
    generate(server, seed, 2)
    generate(server, seed, 2)
    stats = rounds_stats(server)
    assert (stats["rounds_formed"], stats["wait_added_s"]) == (before["rounds_formed"], before["wait_added_s"])
    rounds_before = stats["rounds_formed"]
    prompts = [SEP.join([f"You are agent {'number ' * i}{i}.", BLOCK_A, BLOCK_B, " What now?"]) for i in range(3)]
    sent = []
    for i, prompt in enumerate(prompts):
        sent.append(Sent(server, prompt))
        wait_until(lambda: rounds_stats(server)["held_requests"] == i + 1)
    for s in sent:
        s.join()
        assert s.result.status_code == 200
    stats = rounds_stats(server)
    assert stats["rounds_formed"] == rounds_before + 1
    record = stats["recent_rounds"][-1]
    assert record["inferred"] and record["members"] == 3 and record["admitted"] == [3]


def test_a_round_reading_the_same_blocks_is_probed_once_and_recomputes_the_same_offsets(server):
    """Aligned selection with one prober: in a round whose members all read blocks A and B (cached
    by an earlier request), one member probes them and every other member adopts all its restored
    tokens; each member recomputes the same number of them. A round of one adopts nothing."""
    def run(round_id: str, texts: list[str]) -> list[dict]:
        sent = [Sent(server, text, tokendance={"round": round_id, "round_size": len(texts)}) for text in texts]
        for s in sent:
            s.join()
            assert s.result.status_code == 200, s.result.text
        assert record_of(server, round_id)["admitted"] == [len(texts)]
        return [s.result.json() for s in sent]

    run("prime", [SEP.join(["Notes.", BLOCK_A, BLOCK_B, " Summarise."])])  # caches A and B
    blocks = [[BLOCK_A, BLOCK_B], [BLOCK_B, BLOCK_A], [BLOCK_A, BLOCK_B]]
    texts = [SEP.join([f"You are agent {i}, a careful reader.", *order, " What now?"])
             for i, order in enumerate(blocks)]
    infos = [out["meta_info"]["tokendance"] for out in run("aligned", texts)]
    restored = [info["reused_tokens"] + info["recomputed_tokens"] for info in infos]
    assert all(info["segment_hits"] == 2 for info in infos) and len(set(restored)) == 1
    assert sorted(info["adopted_tokens"] for info in infos) == [0, restored[0], restored[0]]
    assert len({info["recomputed_tokens"] for info in infos}) == 1 and infos[0]["recomputed_tokens"] > 0
    [alone] = run("alone", texts[:1])
    assert alone["meta_info"]["tokendance"]["adopted_tokens"] == 0


def test_openai_extra_body_and_frontend_carry_the_round(server):
    import sglang as sgl

    import sglang_tokendance.lang  # noqa: F401  (sgl.gen(round=...), sglang_tokendance.lang.round)
    from sglang_tokendance.lang import round as agent_round

    body = {"model": "m", "max_tokens": 2, "temperature": 0, "tokendance": {"round": "openai", "round_size": 2}}
    completion = threading.Thread(target=requests.post, args=(server + "/v1/completions",),
                                  kwargs={"json": {**body, "prompt": "One"}, "timeout": 600})
    completion.start()
    chat = requests.post(server + "/v1/chat/completions", timeout=600,
                         json={**body, "messages": [{"role": "user", "content": "Two"}]})
    completion.join()
    assert chat.status_code == 200 and record_of(server, "openai")["admitted"] == [2]

    @sgl.function
    def agent(s, i):
        s += f"Agent {i} speaks."
        s += sgl.gen("answer", max_tokens=2, temperature=0)

    with agent_round("frontend", 3):
        agent.run_batch([{"i": i} for i in range(3)], backend=sgl.RuntimeEndpoint(server), num_threads=3)
    assert record_of(server, "frontend")["admitted"] == [3]

    @sgl.function
    def tagged(s):
        s += "Tagged."
        s += sgl.gen("answer", max_tokens=2, temperature=0, round="keyword", round_size=1)

    tagged.run(backend=sgl.RuntimeEndpoint(server)).sync()
    assert record_of(server, "keyword")["members"] == 1


BAD_ROUNDS = [
    ({"round": 7}, "non-empty string"),
    ({"round": ""}, "non-empty string"),
    ({"round": "r" * 300}, "non-empty string"),
    ({"round": "r", "round_size": 0}, "round_size"),
    ({"round": "r", "round_size": 10 ** 9}, "round_size"),
    ({"round": "r", "round_size": "4"}, "round_size"),
    ({"round": "r", "round_size": True}, "round_size"),
    ({"round_size": 2}, "needs `tokendance.round`"),
    ({"round": "r", "size": 2}, "must be an object like"),
    ({"agent": ""}, "non-empty string"),
    ({"agent": ["alice"]}, "non-empty string"),
]
DENSE_ONLY_REFUSED = [({"agent": "alice"}, "needs --tokendance-storage mirror")]  # this module's server is dense


def test_bad_round_fields_are_400s(server):
    for options, message in BAD_ROUNDS + DENSE_ONLY_REFUSED:
        for path, body in (("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}}),
                           ("/generate", {"text": "a", "stream": True}),
                           ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": 2})):
            r = requests.post(server + path, json={**body, "tokendance": options}, timeout=120)
            assert r.status_code == 400 and message in r.text, (path, options, r.status_code, r.text)
    assert rounds_stats(server)["tracked_requests"] == 0
    assert requests.get(server + "/health", timeout=30).status_code == 200


def test_round_series_on_metrics(server):
    text = requests.get(server + "/metrics", timeout=60).text
    formed = [line for line in text.splitlines() if line.startswith("sglang:tokendance_rounds_formed_total")]
    assert formed and float(formed[0].split()[-1]) >= 3
    assert "sglang:tokendance_round_wait_seconds_total" in text
