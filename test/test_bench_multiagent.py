"""The multi-agent benchmark driver: round structure against a fake server, and one real run."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from sglang_tokendance.bench.multiagent import MODES, RoundRecord, RunResult, run_load
from sglang_tokendance.bench.workloads import PRESETS, WorkloadConfig, make_simulation
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP


class FakeServer:
    """Streams '<agent line> said <n>' for each prompt and records every body it got."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.keys: list[str | None] = []  # each request's routing key (SGLang's router)
        self.fail_every = 0  # when set, every fail_every-th request gets a 503
        self.loop = asyncio.new_event_loop()
        self.app = web.Application()
        self.app.router.add_post("/generate", self.generate)
        self.app.router.add_get("/v1/loads", self.loads)
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        started.wait(10)

    def _serve(self, started):
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        started.set()
        self.loop.run_forever()

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.keys.append(request.headers.get("X-SMG-Routing-Key"))
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.Response(status=503, text="overloaded")
        text = f"reply {len(self.bodies)}"
        ids = [len(body["text"]) % 97, 0]
        if not body.get("stream"):  # a non-streamed answer's second token is 1 after an odd-length prompt
            ids[1] = len(body["text"]) % 2
            meta = {"prompt_tokens": len(body["text"]), "cached_tokens": 1, "completion_tokens": 2}
            return web.json_response({"text": text, "output_ids": ids, "meta_info": meta})
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i, part in enumerate([text[:3], text]):
            meta = {"prompt_tokens": len(body["text"]), "cached_tokens": 1, "completion_tokens": i + 1}
            chunk = {"text": part, "output_ids": ids[:i + 1], "meta_info": meta}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def loads(self, request):
        return web.json_response({"loads": [{"num_used_tokens": 7}]})


def opts(body: dict) -> dict:
    """The TokenDance options a body carries: JSON text in `custom_labels` (passes a router)."""
    return json.loads((body.get("custom_labels") or {}).get("tokendance", "{}"))


class Progress:
    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k


@pytest.fixture(scope="module")
def fake():
    return FakeServer()


@pytest.mark.parametrize("mode", ["radix", "tokendance", "tokendance-collective"])
def test_rounds_feed_outputs_forward(fake, mode):
    fake.bodies.clear()
    fake.keys.clear()
    config = WorkloadConfig(**{**PRESETS["generative_agents"].__dict__, "num_agents": 3, "num_rounds": 3})
    progress = Progress()
    result = asyncio.run(run_load(fake.url, MODES[mode], config, 2, float("inf"), progress))
    assert progress.n == 6 and len(result.rounds) == 6 and len(result.requests) == 18
    assert len(fake.bodies) == 18
    assert all((SEP in b["text"]) == (mode != "radix") for b in fake.bodies)
    assert all(b["stream"] and b["sampling_params"]["temperature"] == 0 for b in fake.bodies)
    # TokenDance registers every output as the next round's shared block; stock gets no field.
    assert all(opts(b).get("register_output", False) == (mode != "radix") for b in fake.bodies)
    rounds = {opts(b)["round"] for b in fake.bodies if "round" in opts(b)}
    if mode == "tokendance-collective":  # a named round per session and round, of all its agents
        assert len(rounds) == 6 and all(opts(b)["round_size"] == 3 for b in fake.bodies)
    else:
        assert not rounds
    # one routing key per simulation, on every request of it
    keys = {text_key for text_key in fake.keys}
    assert len(keys) == 2 and None not in keys
    sim = make_simulation(config)
    # Round 0 of session 0 shares the seed messages; later rounds share real outputs.
    session0 = [b for b in fake.bodies if sim.agents[0].history.split("\n")[0] in b["text"]]
    assert sim.seed_messages[1].strip() in session0[0]["text"]
    replies = [r.text for r in result.requests if r.session == 0 and r.round == 0]
    later = [b for b in session0[1:] if "Round 2" in b["text"]]
    assert later and all(reply in later[0]["text"] for reply in replies)
    for record in result.requests:
        assert 0 < record.ttft <= record.latency and record.completion_tokens == 2
    for r in result.rounds:
        assert r.prefill <= r.latency and r.decode == pytest.approx(r.latency - r.prefill)
    assert result.summary()["peak_kv_used_tokens"] == 7


def test_a_simulation_named_on_every_request_is_ended_by_its_last_round_only(fake):
    fake.bodies.clear()
    config = WorkloadConfig(**{**PRESETS["generative_agents"].__dict__, "num_agents": 2, "num_rounds": 3})
    asyncio.run(run_load(fake.url, MODES["tokendance-unmarked-sim-end"], config, 2, float("inf"), Progress()))
    assert len(fake.bodies) == 12 and len({opts(b)["simulation"] for b in fake.bodies}) == 2
    ended = ["Round 3" in b["text"] for b in fake.bodies if opts(b).get("end_simulation")]
    assert ended == [True] * 4


def test_a_simulation_thinks_between_its_rounds_not_after_its_last(fake):
    """--think-seconds: each session pauses between its rounds (its world steps), so another
    session's round can start meanwhile; none after its last round; a negative pause is refused."""
    from sglang_tokendance.bench_multiagent import parse_args

    config = WorkloadConfig(**{**PRESETS["generative_agents"].__dict__, "num_agents": 2, "num_rounds": 3,
                               "think_seconds": 0.3})
    result = asyncio.run(run_load(fake.url, MODES["radix"], config, 1, float("inf"), Progress()))
    starts = sorted(r.start for r in result.rounds)
    ends = sorted(r.start + r.latency for r in result.rounds)
    assert all(start - end >= 0.3 for start, end in zip(starts[1:], ends))
    assert result.wall < sum(r.latency for r in result.rounds) + 2 * 0.3 + 0.25  # no pause after the last
    with pytest.raises(ValueError):
        WorkloadConfig(think_seconds=-1.0)
    with pytest.raises(SystemExit):
        parse_args(["--think-seconds", "-2"])


@pytest.mark.parametrize("mode", ["radix", "tokendance-kept"])
def test_a_conversation_prompt_extends_the_agents_previous_prompt_and_answer(fake, mode):
    fake.bodies.clear()
    config = WorkloadConfig(**{**PRESETS["debate"].__dict__, "num_agents": 2, "num_rounds": 3, "conversation": True})
    result = asyncio.run(run_load(fake.url, MODES[mode], config, 1, float("inf"), Progress()))
    assert len(fake.bodies) == 6 and not result.errors
    sim = make_simulation(config)
    by_agent = {agent: [b for b in fake.bodies if b["text"].startswith(sim.agents[agent].history)] for agent in (0, 1)}
    for agent, bodies in by_agent.items():
        replies = [r.text for r in result.requests if r.agent == agent]
        for before, after, reply in zip(bodies, bodies[1:], replies):
            assert after["text"].startswith(before["text"] + (SEP if mode != "radix" else "") + reply)
        options = [opts(b).get("agent") for b in bodies]
        assert options == ([None] * 3 if mode == "radix" else [options[0]] * 3)
    computed = result.summary()["computed_tokens_by_round"]  # the fake reports 1 cached token and no computed count
    assert computed == {k: sum(r.prompt_tokens - 1 for r in result.requests if r.round == k) for k in range(3)}
    if mode != "radix":  # one name per agent, never another's
        assert opts(by_agent[0][0])["agent"] != opts(by_agent[1][0])["agent"]


def test_full_prefill_replay_sends_each_round_again_and_counts_identical_outputs(fake):
    from sglang_tokendance.bench.full_prefill import agreement, replay

    fake.bodies.clear()
    config = WorkloadConfig(**{**PRESETS["debate"].__dict__, "num_agents": 2, "num_rounds": 2, "conversation": True})
    result = asyncio.run(run_load(fake.url, MODES["tokendance-kept"], config, 1, float("inf"), Progress()))
    served = [b["text"] for b in fake.bodies]
    fake.bodies.clear()
    progress = Progress()
    answers = replay(fake.url, result.requests, 5, progress)
    assert progress.n == 4 and sorted(b["text"] for b in fake.bodies) == sorted(served)
    assert all(b["sampling_params"] == {"max_new_tokens": 5, "temperature": 0} and "custom_labels" not in b
               and not b.get("stream") for b in fake.bodies)
    # Each answer is the one to its own prompt: the fake's outputs agree after even-length prompts only.
    same = [len(r.prompt) % 2 == 0 for r in result.requests]
    assert [a.output_ids == r.output_ids for a, r in zip(answers, result.requests)] == same
    row = agreement("kept", result.requests, answers)
    assert row["identical"] == sum(same)
    assert row["mean_common_prefix_tokens"] == pytest.approx((2 * sum(same) + 4 - sum(same)) / 4)
    assert row["same_prompt_lengths"] and set(row["identical_fraction_by_round"]) == {0, 1}


def test_agreement_counts_by_round_and_flags_prompts_of_another_length():
    from sglang_tokendance.bench.full_prefill import Reference, agreement
    from sglang_tokendance.bench.multiagent import RequestRecord

    def record(round_index, ids, prompt_tokens=10, reused=0):
        return RequestRecord(0, round_index, 0, 0.1, 0.2, prompt_tokens, 0, len(ids), reused, "", prompt="p",
                             output_ids=ids)

    records = [record(0, [1, 2, 3], reused=4), record(0, [1, 2, 4]), record(1, [5, 6], prompt_tokens=11, reused=2)]
    references = [Reference([1, 2, 3], 10), Reference([1, 2, 3], 10), Reference([7], 10)]
    row = agreement("m", records, references)
    assert (row["identical"], row["identical_fraction_by_round"]) == (1, {0: 0.5, 1: 0.0})
    assert row["mean_common_prefix_tokens"] == pytest.approx(5 / 3)
    assert row["mean_common_prefix_share"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert row["reused_share"] == pytest.approx(6 / 31)
    assert not row["same_prompt_lengths"]
    with pytest.raises(ValueError, match="2 requests but 3 references"):
        agreement("m", records[:2], references)


def test_failed_requests_are_counted_and_the_round_goes_on(fake):
    fake.bodies.clear()
    fake.fail_every = 4
    try:
        config = WorkloadConfig(**{**PRESETS["generative_agents"].__dict__, "num_agents": 3, "num_rounds": 3})
        result = asyncio.run(run_load(fake.url, MODES["tokendance"], config, 1, float("inf"), Progress()))
    finally:
        fake.fail_every = 0
    assert len(fake.bodies) == 9 and len(result.errors) == 2 and all("503" in e for e in result.errors)
    assert len(result.requests) == 7 and len(result.rounds) == 3
    summary = result.summary()
    assert summary["errors"] == 2 and summary["num_requests"] == 7
    ttfts = sorted(r.ttft for r in result.requests)
    assert ttfts[0] <= summary["p50_ttft_s"] <= summary["p99_ttft_s"] <= ttfts[-1]
    # request 4 (round 1) failed: its agent's round-0 reply stays its message in round 2
    last = fake.bodies[-1]["text"]
    assert sum(f"reply {k}" in last for k in (1, 2, 3)) == 1 and "reply 5" in last and "reply 6" in last


def test_error_answers_fail_loudly(fake):
    from sglang_tokendance.bench import multiagent

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as http:
            await multiagent.stream_generate(http, fake.url + "/nowhere", {"text": "x"})

    with pytest.raises(RuntimeError, match="404"):
        asyncio.run(go())


@pytest.mark.slow
def test_cli_compares_stock_radix_and_tokendance(tmp_path, tiny_llama):
    from sglang_tokendance import bench_multiagent

    out = tmp_path / "ma.jsonl"
    bench_multiagent.main(["--modes", "radix,tokendance", "--num-agents", "2", "--num-rounds", "2", "--quality",
                           "--model-path", tiny_llama, "--max-new-tokens", "4", "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    summaries = {r["mode"]: r for r in records if r["type"] == "summary"}
    assert set(summaries) == {"radix", "tokendance"}
    assert summaries["radix"]["round_speedup_vs_radix"] == pytest.approx(1.0)
    assert summaries["tokendance"]["num_requests"] == 4
    assert {r["type"] for r in records} >= {"meta", "request", "round", "kv", "idle"}
    md = out.with_suffix(".md").read_text()
    assert "python -m" in md and "--num-agents 2" in md
    assert "Prompt tokens computed by round" in md and set(summaries["radix"]["computed_tokens_by_round"]) == {"0", "1"}
    agreement = {r["mode"]: r for r in records if r["type"] == "full_prefill_agreement"}
    assert set(agreement) == {"radix", "tokendance"}  # every request sent again to a full-prefill server
    assert all(r["requests"] == 4 and r["same_prompt_lengths"] for r in agreement.values())
    assert "Greedy outputs against a full prefill" in md
    for png in ("ma_round_latency.png", "ma_round_prefill.png", "ma_kv_usage.png", "ma_full_prefill_agreement.png"):
        assert (tmp_path / png).stat().st_size > 1000


@pytest.mark.slow
def test_capacity_mode_finds_max_agents_under_slo(tmp_path, tiny_llama):
    from sglang_tokendance import bench_multiagent

    out = tmp_path / "cap.jsonl"
    bench_multiagent.main(["--capacity", "--modes", "radix", "--capacity-rates", "4", "--max-agents", "2",
                           "--capacity-repeats", "2", "--model-path", tiny_llama,
                           "--num-rounds", "1", "--max-new-tokens", "2", "--slo-ms", "600000",
                           "--max-total-tokens", "8192", "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    capacity = [r for r in records if r["type"] == "capacity"]
    # A 10-minute SLO holds for every probe, so both searches reach --max-agents.
    assert [(r["rate"], r["max_agents"], r["per_repeat"]) for r in capacity] == [(4.0, 2, "2, 2")]
    probes = [r for r in records if r["type"] == "capacity_probe"]
    assert [(p["repeat"], p["num_agents"]) for p in probes] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(p["under_slo"] and p["fits"] and p["peak_kv_tokens_per_agent"] >= 0 for p in probes)
    assert (capacity[0]["stopped_by"], capacity[0]["agents_vs_radix"]) == ("none, none", 1.0)
    assert [(r["repeat"], r["mode"]) for r in records if r["type"] == "idle"] == [(0, "radix"), (1, "radix")]
    assert meta_of(records)["max_total_tokens"] == 8192
    for png in ("cap_capacity_latency.png", "cap_capacity_agents.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_an_slo_search_says_whether_memory_or_compute_stopped_it():
    from sglang_tokendance.bench.capacity import what_stopped

    held = {"under_slo": True, "fits": True}
    assert what_stopped([held, {"under_slo": False, "fits": False}]) == "memory"
    assert what_stopped([held, {"under_slo": False, "fits": True}]) == "compute"
    assert what_stopped([{**held, "fits": False}, held]) == "none"  # a probe under the SLO never stops it


def test_capacity_repeats_reverse_the_modes_order_every_other_time():
    from sglang_tokendance.bench.systems import mode_orders
    from sglang_tokendance.bench_multiagent import parse_args

    modes = [MODES["radix"], MODES["tokendance"], MODES["tokendance-mirror"]]
    orders = [[m.name for m in order] for order in mode_orders(modes, 3)]
    assert orders == [["radix", "tokendance", "tokendance-mirror"], ["tokendance-mirror", "tokendance", "radix"],
                      ["radix", "tokendance", "tokendance-mirror"]]
    with pytest.raises(SystemExit):
        parse_args(["--capacity", "--capacity-repeats", "0"])


@pytest.mark.slow
def test_capacity_fit_finds_the_most_agents_live_at_once_at_the_kv_budget(tmp_path, tiny_llama):
    """At 1000 KV tokens the round-1 prompts of four agents (~220 tokens each) are live at once;
    five are not, so the fifth waits in SGLang's queue for another's KV and the search stops."""
    from sglang_tokendance import bench_multiagent

    out = tmp_path / "fit.jsonl"
    bench_multiagent.main(["--capacity", "fit", "--modes", "radix", "--min-agents", "3", "--max-agents", "6",
                           "--model-path", tiny_llama, "--num-rounds", "2", "--max-new-tokens", "4",
                           "--max-total-tokens", "1000", "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    probes = [r for r in records if r["type"] == "fit_probe"]
    assert [(p["num_agents"], p["fits"], p["all_live"]) for p in probes] == [(3, True, True), (4, True, True),
                                                                             (5, False, False)]
    assert all(p["retracted"] == 0 and p["peak_kv_used_tokens"] <= 1000 for p in probes)
    assert probes[2]["num_agents"] * probes[2]["prompt_tokens_per_agent"] > 1000  # the budget bound
    (row,) = [r for r in records if r["type"] == "capacity_fit"]
    assert (row["mode"], row["max_agents"], row["budget_tokens"]) == ("radix", 4, 1000)
    assert row["peak_kv_tokens_per_agent"] == probes[1]["peak_kv_tokens_per_agent"]
    assert (tmp_path / "fit_capacity_fit.png").stat().st_size > 1000


def test_a_round_fits_when_every_request_was_live_at_once_and_none_was_retracted():
    from sglang_tokendance.bench.multiagent import RequestRecord
    from sglang_tokendance.bench.capacity import fit_probe

    def request(round_index, ttft, latency):
        return RequestRecord(0, round_index, 0, ttft, latency, 100, 0, 8, 0, "")

    result = RunResult("radix", 2, float("inf"))
    result.rounds = [RoundRecord(0, k, 2, start=0.0, latency=3.0, prefill=1.0, decode=2.0, peak_kv_tokens=400)
                     for k in (0, 1)]
    queued_first_round = [request(0, 0.5, 1.0), request(0, 1.5, 3.0)]  # the second began after the first ended
    result.requests = [*queued_first_round, request(1, 0.5, 2.0), request(1, 0.9, 3.0)]
    probe = fit_probe(result, {0: 1})
    assert probe["fits"] and probe["peak_kv_tokens_per_agent"] == 200  # only rounds past the first count
    assert not fit_probe(result, {1: 1})["fits"]  # a retraction while round 1 ran
    result.requests[3] = request(1, 2.5, 3.0)  # round 1's second request queued behind the first
    assert not fit_probe(result, {})["all_live"]
    result.rounds, result.requests = result.rounds[:1], queued_first_round  # a one-round run: its round counts
    assert not fit_probe(result, {})["fits"]


def test_the_agent_search_stops_at_the_first_count_that_does_not_hold():
    from sglang_tokendance.bench.capacity import most_agents
    from sglang_tokendance.bench_multiagent import parse_args

    tried = []

    def holds(n):
        tried.append(n)
        return n in (3, 4, 6)

    assert most_agents(3, 8, holds) == 4 and tried == [3, 4, 5]
    assert most_agents(2, 8, holds) == 1  # not even the first
    with pytest.raises(SystemExit):
        parse_args(["--capacity", "fit", "--num-sessions", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--capacity", "--min-agents", "0"])
    assert parse_args(["--capacity"]).capacity == "slo"


def meta_of(records):
    return next(r for r in records if r["type"] == "meta")


def test_cli_drives_a_running_server(fake, tmp_path):
    from sglang_tokendance import bench_multiagent

    fake.bodies.clear()
    out = tmp_path / "running.jsonl"
    bench_multiagent.main(["--base-url", fake.url, "--backend", "sglang", "--num-agents", "2",
                           "--num-rounds", "2", "--num-sessions", "2", "--request-rate", "50",
                           "--no-plot", "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    (summary,) = [r for r in records if r["type"] == "summary"]
    assert summary["mode"] == "sglang" and summary["num_requests"] == 8
    assert len(fake.bodies) == 8 + 1  # 2 sessions x 2 rounds x 2 agents, plus the warm-up
    assert not any(SEP in b["text"] or "tokendance" in b for b in fake.bodies)


@pytest.mark.parametrize("scenario", ["plain", "ratio-one", "default", "unscreened-dense", "screened-dense"])
def test_token_layers_from_the_servers_counts_match_the_blended_prefills(scenario):
    """The benchmark's work count, from per-request reused/recomputed tokens, equals what
    core/blend counted (token granularity, no head tokens)."""
    import torch

    from sglang_tokendance.bench_multiagent import token_layers
    from sglang_tokendance.bench.multiagent import RequestRecord
    from sglang_tokendance.core.blend import blended_prefill
    from sglang_tokendance.core.selection import rule_named
    from test_blend_golden import SCENARIOS, batch, tiny

    model = tiny("llama")
    ids, positions, rows, kv = batch(model)
    options, rule = SCENARIOS[scenario]
    with torch.no_grad():
        _, stats = blended_prefill(model, kv, ids, positions, rows, options, rule and rule_named(rule))
    total, start = 0, 0
    for row in rows:
        reused = sum(run.end - run.start for run in row.reused)
        kept = 0 if stats.kept is None else int(stats.kept[start:start + reused].sum())
        start += reused
        record = RequestRecord(0, 0, 0, 0.0, 0.0, row.prefix_len + row.num_tokens, row.prefix_len, 1,
                               reused - kept, "", recomputed_tokens=kept)
        total += token_layers(record, options, model.num_layers)
    assert total == stats.token_layers


def test_a_rounds_peak_kv_counts_only_samples_taken_while_it_ran():
    result = RunResult("tokendance", 2, float("inf"), t0=100.0)
    result.rounds = [RoundRecord(0, 0, 2, start=101.0, latency=2.0, prefill=1.0, decode=1.0),
                     RoundRecord(0, 1, 2, start=104.0, latency=1.0, prefill=0.5, decode=0.5)]
    result.kv_usage = [(0.5, 900), (1.0, 10), (2.5, 40), (3.0, 30), (3.5, 800), (4.2, 6), (5.0, 8), (6.0, 700)]
    result.record_round_peaks()
    assert [r.peak_kv_tokens for r in result.rounds] == [40, 8]
    assert result.summary()["peak_kv_tokens_per_agent"] == pytest.approx((20 + 4) / 2)


def test_token_layers_count_a_shared_probe():
    """With a shared probe the members that adopt a segment skip its probe and catch up their
    kept tokens: the count from per-request adopted/recomputed tokens equals core/blend's."""
    import torch

    from sglang_tokendance.bench.multiagent import RequestRecord
    from sglang_tokendance.bench_multiagent import token_layers
    from test_blend_golden import tiny
    from test_blend_groups import SHARED_PROBE, Round

    model = tiny("llama")
    together = Round(model)
    with torch.no_grad():
        _, stats, _ = together.run(model, SHARED_PROBE)
    total, start = 0, 0
    for row in together.rows:
        reused = sum(run.end - run.start for run in row.reused)
        kept = int(stats.kept[start:start + reused].sum())
        adopted = int(stats.adopted[start:start + reused].sum())
        start += reused
        record = RequestRecord(0, 0, 0, 0.0, 0.0, row.num_tokens, 0, 1, reused - kept, "", recomputed_tokens=kept,
                               adopted_tokens=adopted)
        total += token_layers(record, SHARED_PROBE, model.num_layers)
    assert total == stats.token_layers and stats.adopted_tokens > 0


def test_mirror_compression_is_reused_positions_per_own_slot():
    from sglang_tokendance.bench.multiagent import RequestRecord, mirror_compression

    def record(reused, recomputed, own):
        return RequestRecord(0, 0, 0, 0.0, 0.0, 100, 0, 1, reused, "", recomputed_tokens=recomputed,
                             mirror_diff_tokens=own)

    assert mirror_compression([record(70, 30, 30), record(140, 60, 60)]) == pytest.approx(300 / 90)
    assert mirror_compression([record(70, 30, 100)]) == 1.0  # a dense copy
    assert mirror_compression([record(0, 0, 0)]) != mirror_compression([record(0, 0, 0)])  # nan: nothing reused


def test_prefill_rows_are_fractions_of_radix_in_time_and_of_a_full_prefill_in_work():
    from sglang_tokendance.bench.multiagent import RequestRecord
    from sglang_tokendance.bench_multiagent import prefill_rows

    def result(mode, prefills, reused, recomputed):
        run = RunResult(mode, 2, float("inf"))
        run.rounds = [RoundRecord(0, i, 2, start=0.0, latency=t, prefill=t, decode=0.0) for i, t in enumerate(prefills)]
        run.requests = [RequestRecord(0, 1, a, 0.0, 0.0, 100, 20, 1, reused, "", recomputed_tokens=recomputed)
                        for a in range(2)]
        return run

    results = {("radix", 2): [result("radix", [4.0, 8.0], 0, 0)],
               ("tokendance-plain", 2): [result("tokendance-plain", [2.0, 2.0], 60, 0)]}
    rows = prefill_rows([MODES["radix"], MODES["tokendance-plain"]], [2], results, layers=10)
    radix, plain = rows
    assert radix["time_fraction"] == radix["speedup"] == radix["work_fraction"] == 1.0
    assert plain["time_fraction"] == pytest.approx(0.25) and plain["speedup"] == pytest.approx(4.0)
    assert plain["round0_time_fraction"] == pytest.approx(0.5)
    assert plain["work_fraction"] == pytest.approx(20 / 80)  # fresh tokens only, of the 80 past the radix prefix


def test_scale_out_takes_one_mode_and_counts_every_cache():
    from sglang_tokendance.bench.multiagent import RequestRecord
    from sglang_tokendance.bench_multiagent import parse_args, reuse_share_by_round, scale_out_row

    assert parse_args(["--workers", "2"]).modes == "tokendance-rounds"
    assert parse_args([]).modes == "radix,no-cache,tokendance"
    for bad in (["--workers", "1"], ["--workers", "2", "--modes", "radix,tokendance"],
                ["--workers", "2", "--capacity"], ["--workers", "2", "--port", "30000"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    result = RunResult("tokendance-rounds", 2, float("inf"), wall=2.0)
    # (round, prompt, exact prefix, kept, recomputed): served from a cache = prefix + kept + recomputed
    for round_index, prompt, cached, kept, recomputed in ((0, 100, 0, 0, 0), (0, 100, 10, 50, 20),
                                                          (1, 200, 100, 40, 10), (1, 100, 0, 0, 0)):
        result.requests.append(RequestRecord(0, round_index, 0, 0.1, 0.2, prompt, cached, 4, kept, "x",
                                             recomputed_tokens=recomputed, segment_hits=1))
    assert reuse_share_by_round(result) == {0: 80 / 200, 1: 150 / 300}
    row = scale_out_row("2 workers, manual", result, [3, 0], {"idle": True})
    assert row["reuse_share"] == 230 / 500 and row["rounds_per_worker"] == "3/0" and row["segment_hits"] == 4
    assert row["completion_tokens_per_s"] == 16 / 2.0
