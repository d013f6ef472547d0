"""Batch invariance on a live server (tiny random-weight Llama): a request's logits do not
depend on which other requests share its prefill batch, on every reuse path. The same request
is answered twice from the same cache state (flushed, the same blocks cached, the same earlier
rounds sent): once as the only member of its round, once beside others that read the same
Masters in the same batch, where the batch is long enough to be cut into chunks (planned
selection) while the request alone is not. Its top logprobs must agree within fp tolerance.

Paths: dense storage without a leader (every member reads the cached Masters), mirror storage
(the CPU's default) with its round leader (followers read the leader's Masters in place); each
with a first round (blocks read approximately) and a second: under dense storage the briefing
recurs at the exact frontier (computed exactly), under mirror storage the member continues its
kept row of the first round; either way credited to the budget of the messages still reused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import generate
from sglang_tokendance.bench.server_process import ServerProcess, flush_cache
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP

pytestmark = pytest.mark.slow

CHUNK = 256  # a member alone fits one chunk; four together do not
TOP = 8
NOTES = [f"Private notes of agent {name}: {name} keeps bees behind the old mill, walks the river path at dawn, "
         f"and has promised the council a report on the flooded north road before market day."
         for name in ("Ada", "Tom", "Mei", "Omar")]
BRIEFING = ("Briefing for every resident: the ferry runs twice a day until the storm passes, the bakery "
            "opens late on Sundays, and the library hosts the town meeting in its reading room at seven.")
STATEMENTS = [[f"{name} said in round {r}: I will bring {item} to the square and help whoever needs a hand "
               f"with the stalls before the rain comes back tonight."
               for name, item in (("Ada", "honey"), ("Tom", "bread"), ("Mei", "lamps"), ("Omar", "rope"))]
              for r in range(2)]


LEADS = ("The chair's agenda: first the ferry timetable, then the stalls on the square, then any other business "
         "the residents raise before the meeting closes at nine.")  # only agent 0 holds it: it leads its rounds


def prompt(agent: int, round_index: int) -> str:
    said = STATEMENTS[round_index]
    order = [said[(agent + k) % len(said)] for k in range(len(said))]
    extra = [LEADS] if agent == 0 else []
    return SEP.join([NOTES[agent], BRIEFING, *extra, *order, f"Agent {agent}, what do you say next?"])


@pytest.fixture(scope="module", params=["dense", "mirror"])
def server(request, tiny_llama):
    flags = ["--model-path", tiny_llama, "--chunked-prefill-size", str(CHUNK), "--tokendance-round-window-ms", "60000"]
    if request.param == "mirror":
        flags += ["--tokendance-storage", "mirror"]
    else:
        flags += ["--tokendance-storage", "dense", "--no-tokendance-round-leader"]
    with ServerProcess(flags) as proc:
        yield proc.url, request.param == "mirror"


def send_round(url: str, round_id: str, agents: list[int], round_index: int) -> dict[int, dict]:
    """The agents' prompts as one named round (admitted together once complete), answered
    greedily with top logprobs."""
    def one(agent: int) -> dict:
        return generate(url, prompt(agent, round_index), max_new_tokens=3, return_logprob=True,
                        top_logprobs_num=TOP, tokendance={"round": round_id, "round_size": len(agents)})

    with ThreadPoolExecutor(len(agents)) as pool:
        return dict(zip(agents, pool.map(one, agents)))


def fresh_state(url: str, rounds_before: int) -> None:
    """The same cache state each time: emptied, every block cached on its own, then the
    earlier rounds sent (their blocks read approximately: sighted where they sat)."""
    flush_cache(url)
    for block in [BRIEFING, LEADS, *STATEMENTS[0], *STATEMENTS[1]]:
        generate(url, SEP + block + SEP, max_new_tokens=1)
    for r in range(rounds_before):
        send_round(url, f"warm-{r}", [0, 1, 2, 3], r)


def tops(answer: dict) -> list[dict[int, float]]:
    return [{int(e[1]): float(e[0]) for e in step} for step in answer["meta_info"]["output_top_logprobs"]]


@pytest.mark.parametrize("round_index", [0, 1])
def test_a_members_logits_do_not_depend_on_its_batch_mates(server, round_index):
    """Under a round leader (mirror server) the member is a follower both times: agent 0,
    holding one block more, leads (prefilled exactly first, its blocks the Masters read)."""
    url, led = server
    agent = 1
    fresh_state(url, round_index)
    alone = send_round(url, f"alone-{round_index}", [0, agent] if led else [agent], round_index)
    fresh_state(url, round_index)
    together = send_round(url, f"together-{round_index}", [0, agent, 2, 3], round_index)
    if led:
        assert alone[0]["meta_info"]["tokendance"]["round_master_tokens"] > 0
        assert together[0]["meta_info"]["tokendance"]["round_master_tokens"] > 0
    a, b = alone[agent], together[agent]
    info_a, info_b = a["meta_info"]["tokendance"], b["meta_info"]["tokendance"]
    assert info_a["reused_tokens"] > 0 and info_b["reused_tokens"] > 0, (info_a, info_b)
    if round_index and led:  # the notes and briefing read from the member's kept row of round 0
        assert info_a["agent_prefix_tokens"] == info_b["agent_prefix_tokens"] > 0
    elif round_index:  # the briefing recurs after the same notes: computed exactly
        assert info_a["exact_recurring_tokens"] == info_b["exact_recurring_tokens"] > 0
    assert a["output_ids"] == b["output_ids"]
    for step_a, step_b in zip(tops(a), tops(b)):
        assert step_a.keys() == step_b.keys()
        assert max(abs(step_a[t] - step_b[t]) for t in step_a) < 1e-4, (step_a, step_b)
