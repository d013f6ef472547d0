"""The main command's table: per round and side, summed over the round's agents."""

from __future__ import annotations

from sglang_tokendance.bench.multiagent import RequestRecord, RoundRecord, RunResult
from sglang_tokendance.demo import round_rows


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
