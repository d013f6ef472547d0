"""The main command's table: per round and side, summed over the round's agents."""

from __future__ import annotations

import re

import pytest

from conftest import emptied
from sglang_tokendance import demo
from sglang_tokendance.bench.multiagent import RequestRecord, RoundRecord, RunResult
from sglang_tokendance.demo import round_rows

HEADERS = ["side", "round", "prompt tokens", "radix prefix", "reused", "recomputed", "segment hits",
           "round prefill s", "round s"]


def test_round_rows_sum_each_rounds_requests():
    result = RunResult("tokendance", num_agents=2, request_rate=float("inf"))
    for rnd, prefill in ((1, 0.8), (0, 1.5)):
        result.rounds.append(RoundRecord(0, rnd, 2, 0.0, prefill + 2.0, prefill, 2.0))
        for agent in range(2):
            result.requests.append(RequestRecord(0, rnd, agent, 0.1, 1.0, 300 + agent, 10, 40, 100 * rnd,
                                                 "hi", recomputed_tokens=30 * rnd, segment_hits=2 * rnd))
    rows = round_rows(result)
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[1] == {"side": "tokendance", "round": 2, "prompt tokens": 601, "radix prefix": 20, "reused": 200,
                       "recomputed": 60, "segment hits": 4, "round prefill s": 0.8, "round s": 2.8}
    assert rows[0]["reused"] == 0 and rows[0]["round prefill s"] == 1.5


@pytest.mark.slow
def test_the_main_command_shows_reuse_against_stock_in_one_run(default_server_url, capsys, monkeypatch):
    """The TokenDance side runs on the session's server with the defaults (the demo's own
    flags: none), emptied first; the --disable-tokendance side on a server the demo starts."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    start = demo.ServerProcess
    monkeypatch.setattr(demo, "ServerProcess", lambda argv, **kw: nullcontext(SimpleNamespace(
        url=emptied(default_server_url))) if not argv else start(argv, **kw))
    demo.main(["--num-agents", "3", "--num-rounds", "2", "--max-new-tokens", "16"])
    out = capsys.readouterr().out
    assert out.count("The capital of France is Paris") == 2  # the smoke check, on both servers
    table = {(cells[1], int(cells[2])): dict(zip(HEADERS, cells[1:]))
             for line in out.splitlines() if line.startswith("| ") and "round" not in line.split("|")[2]
             for cells in [[c.strip() for c in line.split("|")]]}
    assert set(table) == {(side, r) for side in ("tokendance", "--disable-tokendance") for r in (1, 2)}
    assert int(table["tokendance", 2]["reused"]) > 0 and int(table["tokendance", 2]["segment hits"]) > 0
    assert int(table["--disable-tokendance", 2]["reused"]) == 0
    assert re.search(r"round 2: prefill \d+\.\d\dx (faster|slower) with TokenDance", out)


def test_a_slowdown_is_called_slower():
    assert demo.speed_words(2.0, 1.0) == "2.00x faster" and demo.speed_words(1.0, 2.0) == "2.00x slower"
