"""Multi-agent rounds against SGLang servers: the code behind `python -m
sglang_tokendance.bench_multiagent`.

A session is one simulation (bench/workloads.py). Each of its rounds sends the N agents'
requests at once; the next round's shared blocks are this round's real outputs. Sessions
arrive at `--request-rate` per second. Per request we record TTFT, latency and token counts
(from a streamed /generate), per round its latency split into prefill (until every agent has
its first token) and decode, and the server's KV usage over time from /v1/loads.

Prefill-only sessions (`prefill_only=True`) time just the prompts' prefill: every request asks
for one token, and the next round's messages are stand-ins (`stand_in_messages`) that each
author registers in an untimed "author prefill" of its own prompt followed by its message, so
a TokenDance server caches each message with its KV computed after its author's prompt (as
output registration would), and a stock server holds it in its radix tree (as after decoding).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager

import aiohttp
import numpy
import requests as requests_lib

from sglang_tokendance.bench.workloads import (Simulation, WorkloadConfig, join_pieces, make_simulation,
                                               message_block, stand_in_messages)
from sglang_tokendance.core.blend_types import BlendOptions
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR
from sglang_tokendance.routing import ROUTING_HEADER, options_label

CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=3600)


@dataclass(frozen=True)
class Mode:
    """How one compared system is started and spoken to."""

    name: str
    stock: bool  # stock sglang.launch_server (TokenDance plugin inert) or ours
    server_args: tuple[str, ...] = ()
    marked: bool = False  # send separators (only a TokenDance server understands them)
    rounds: bool = False  # name each round (`round`, `round_size`): its requests are prefilled as one group
    agents: bool = False  # name each request's agent (`agent`): its finished row is kept for its next prompt
    simulations: bool = False  # name each request's simulation (`simulation`), ended by its last round's requests

    def blend_options(self) -> BlendOptions | None:
        """The blended prefill's options on this mode's server (None for stock SGLang)."""
        if self.stock:
            return None
        import argparse

        from sglang_tokendance.server_args import TokenDanceArgs

        parser = argparse.ArgumentParser()
        TokenDanceArgs.add_cli_args(parser)
        return TokenDanceArgs.from_cli_args(parser.parse_known_args(list(self.server_args))[0]).blend_options()


MODES: dict[str, Mode] = {
    "radix": Mode("radix", stock=True),
    "no-cache": Mode("no-cache", stock=True, server_args=("--disable-radix-cache",)),
    "tokendance": Mode("tokendance", stock=False, marked=True),  # the defaults (on the CPU: mirror storage, kept rows)
    # dense storage (the GPU's default): every reader copies the Masters, the round after an approximate read
    # computes its recurring blocks exactly (no kept rows)
    "tokendance-dense": Mode("tokendance-dense", stock=False, marked=True,
                             server_args=("--tokendance-storage", "dense")),
    # every cached block reused approximately, even where it recurs after the same exact prefix (core/recurrence)
    "tokendance-approximate": Mode("tokendance-approximate", stock=False, marked=True,
                                   server_args=("--no-tokendance-exact-recurrence",)),
    "tokendance-plain": Mode("tokendance-plain", stock=False, marked=True,  # plain reuse, no recompute
                             server_args=("--tokendance-recompute-ratio", "0")),
    "tokendance-full": Mode("tokendance-full", stock=False, marked=True,  # blended path at ratio 1
                            server_args=("--tokendance-recompute-ratio", "1", "--no-tokendance-cost-check")),
    # our server sent prompts without separators: nothing to reuse, it must serve as stock radix does
    "tokendance-unmarked": Mode("tokendance-unmarked", stock=False),
    # eviction by each item's predicted next read (core/next_use), not by recency alone (the default)
    "tokendance-next-use": Mode("tokendance-next-use", stock=False, marked=True,
                                server_args=("--tokendance-eviction", "next-use")),
    "tokendance-unmarked-next-use": Mode("tokendance-unmarked-next-use", stock=False,
                                         server_args=("--tokendance-eviction", "next-use")),
    # unmarked prompts naming their simulation, which its last round ends: what it left is evicted first
    "tokendance-unmarked-sim-end": Mode("tokendance-unmarked-sim-end", stock=False, simulations=True),
    # every matched block blended, even where core/cost estimates SGLang's own path cheaper
    "tokendance-always": Mode("tokendance-always", stock=False, marked=True,
                              server_args=("--no-tokendance-cost-check",)),
    # the collective blended prefill: named rounds, aligned selection, one member probing each shared block
    "tokendance-collective": Mode("tokendance-collective", stock=False, marked=True, rounds=True,
                                  server_args=("--tokendance-group-selection", "aligned",
                                               "--tokendance-group-probe", "1")),
    # named rounds under the defaults: each round's leader prefilled exactly first, its blocks the others' Masters
    "tokendance-rounds": Mode("tokendance-rounds", stock=False, marked=True, rounds=True),
    # named rounds admitted all at once, reading the authors' Masters
    "tokendance-rounds-at-once": Mode("tokendance-rounds-at-once", stock=False, marked=True, rounds=True,
                                      server_args=("--no-tokendance-round-leader",)),
    "tokendance-mirror": Mode("tokendance-mirror", stock=False, marked=True,  # zero-copy Master-Mirror storage
                              server_args=("--tokendance-storage", "mirror")),
    # Master-Mirror storage where a kept token within 0.4 (relative L2, every layer) of its Master reads the Master
    "tokendance-threshold": Mode("tokendance-threshold", stock=False, marked=True,
                                 server_args=("--tokendance-storage", "mirror", "--tokendance-diff-threshold", "0.4")),
    # memory first: Master-Mirror storage at recompute ratio 0.1 (about 10 reused positions per own slot) in named
    # rounds, whose leader's exact blocks are the Masters the others read (a lower ratio keeps their error low)
    "tokendance-mirror-lean": Mode("tokendance-mirror-lean", stock=False, marked=True, rounds=True,
                                   server_args=("--tokendance-storage", "mirror",
                                                "--tokendance-recompute-ratio", "0.1")),
    # Master-Mirror storage with each agent's finished row kept for its next prompt (--conversation)
    "tokendance-kept": Mode("tokendance-kept", stock=False, marked=True, agents=True,
                            server_args=("--tokendance-storage", "mirror")),
}


@dataclass
class RequestRecord:
    session: int
    round: int
    agent: int
    ttft: float
    latency: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reused_tokens: int
    text: str = field(repr=False)
    recomputed_tokens: int = 0  # reused tokens the blended prefill computed again
    computed_tokens: int = 0  # every prompt token the forward computed (0 on stock servers)
    segment_hits: int = 0  # cached segments the request reused
    adopted_tokens: int = 0  # reused tokens that skipped the probe (its round group's shared probe)
    mirror_diff_tokens: int = 0  # own KV slots at its reused positions (all of them under dense storage)
    exact_recurring_tokens: int = 0  # block tokens computed exactly where they recurred after the same prefix
    kept_tokens: int = 0  # its prompt's prefix read from a kept row (its own earlier request's KV, approximate)
    prompt: str = field(default="", repr=False)  # the text it sent (--quality sends it again)
    output_ids: list[int] = field(default_factory=list, repr=False)

    def exact_tokens(self) -> int:
        """Prompt tokens served exactly from the radix tree: SGLang's cached prefix, less the
        part read from a kept row (srt/kept_mirrors: the same text's earlier approximate KV)."""
        return self.cached_tokens - self.kept_tokens

    def prompt_tokens_computed(self) -> int:
        """Prompt tokens the forward computed: the server's count, or (stock SGLang, which
        reports none) every token past the cached prefix."""
        return self.computed_tokens or self.prompt_tokens - self.cached_tokens


@dataclass
class RoundRecord:
    session: int
    round: int
    num_agents: int
    start: float
    latency: float
    prefill: float
    decode: float
    peak_kv_tokens: int = 0  # most KV held by live requests while the round ran (sampled)


@dataclass
class RunResult:
    mode: str
    num_agents: int
    request_rate: float
    requests: list[RequestRecord] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    kv_usage: list[tuple[float, int]] = field(default_factory=list)  # (seconds since `t0`, used tokens)
    t0: float = 0.0  # perf_counter when the run started (rounds' `start` is on the same clock)
    errors: list[str] = field(default_factory=list)  # failed requests (HTTP error, stream error, timeout)
    wall: float = 0.0

    def summary(self) -> dict[str, Any]:
        def mean(xs):
            xs = list(xs)
            return sum(xs) / len(xs) if xs else float("nan")

        by_round: dict[int, list[RoundRecord]] = {}
        for r in self.rounds:
            by_round.setdefault(r.round, []).append(r)
        requests_by_round: dict[int, list[RequestRecord]] = {}
        for q in self.requests:
            requests_by_round.setdefault(q.round, []).append(q)

        def tokens_by_round(count: Callable[[RequestRecord], int]) -> dict[int, int]:
            return {k: sum(count(q) for q in v) for k, v in sorted(requests_by_round.items())}
        return {
            "mode": self.mode,
            "num_agents": self.num_agents,
            "request_rate": self.request_rate,
            "num_requests": len(self.requests),
            "wall_s": self.wall,
            "mean_round_latency_s": mean(r.latency for r in self.rounds),
            "round_latency_by_round_s": {k: mean(r.latency for r in v) for k, v in sorted(by_round.items())},
            "round_prefill_by_round_s": {k: mean(r.prefill for r in v) for k, v in sorted(by_round.items())},
            "computed_tokens_by_round": tokens_by_round(RequestRecord.prompt_tokens_computed),
            "prompt_tokens_by_round": tokens_by_round(lambda q: q.prompt_tokens),
            "cached_tokens_by_round": tokens_by_round(RequestRecord.exact_tokens),
            "kept_tokens_by_round": tokens_by_round(lambda q: q.kept_tokens),
            "reused_tokens_by_round": tokens_by_round(lambda q: q.reused_tokens),
            "mean_round_prefill_s": mean(r.prefill for r in self.rounds),
            "mean_round_decode_s": mean(r.decode for r in self.rounds),
            "mean_ttft_s": mean(q.ttft for q in self.requests),
            "p50_ttft_s": quantile([q.ttft for q in self.requests], 0.5),
            "p99_ttft_s": quantile([q.ttft for q in self.requests], 0.99),
            "p50_round_latency_s": quantile([r.latency for r in self.rounds], 0.5),
            "p99_round_latency_s": quantile([r.latency for r in self.rounds], 0.99),
            "errors": len(self.errors),
            "mean_latency_s": mean(q.latency for q in self.requests),
            "prompt_tokens": sum(q.prompt_tokens for q in self.requests),
            "cached_tokens": sum(q.cached_tokens for q in self.requests),
            "reused_tokens": sum(q.reused_tokens for q in self.requests),
            "completion_tokens": sum(q.completion_tokens for q in self.requests),
            "peak_kv_used_tokens": max((u for _, u in self.kv_usage), default=0),
            "peak_kv_tokens_per_agent": mean(r.peak_kv_tokens / r.num_agents for r in self.rounds),
            "mirror_compression": mirror_compression(self.requests),
        }

    def record_round_peaks(self) -> None:
        """Each round's peak KV in use: the largest sample taken while it ran (the server's
        used tokens: live requests' KV, not what its caches could free)."""
        for r in self.rounds:
            begin, end = r.start - self.t0, r.start - self.t0 + r.latency
            r.peak_kv_tokens = max((u for t, u in self.kv_usage if begin <= t <= end), default=0)


def all_live_at_once(requests: list[RequestRecord]) -> bool:
    """Whether every request of a round had its first token before any of them ended: all held
    their KV at once, none waited in SGLang's queue for another's KV to be freed."""
    return bool(requests) and max(q.ttft for q in requests) < min(q.latency for q in requests)


def retracted_requests(url: str) -> int:
    """Requests the server has retracted so far (SGLang's `num_retracted_requests_total`
    counter, which needs `--enable-metrics`; absent until the first retraction)."""
    text = requests_lib.get(url + "/metrics", timeout=60).text
    if "sglang:" not in text:
        raise RuntimeError(f"{url}/metrics has no SGLang metrics: start the server with --enable-metrics")
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("sglang:num_retracted_requests_total")))


class RetractionWatch:
    """`watch` for `run_load`: the requests the server retracted while each round ran."""

    def __init__(self, url: str):
        self.url = url
        self.by_round: dict[int, int] = {}

    @contextlib.contextmanager
    def __call__(self, round_index: int):
        before = retracted_requests(self.url)
        yield
        self.by_round[round_index] = self.by_round.get(round_index, 0) + retracted_requests(self.url) - before


def mirror_compression(requests: list[RequestRecord]) -> float:
    """Reused positions per own KV slot among them, over the requests that reused (1.0: dense
    copies; nan: nothing reused)."""
    positions = sum(q.reused_tokens + q.recomputed_tokens for q in requests if q.mirror_diff_tokens)
    own = sum(q.mirror_diff_tokens for q in requests)
    return positions / own if own else float("nan")


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile (linear interpolation, numpy's default), nan for no samples."""
    return float(numpy.quantile(xs, q)) if xs else float("nan")


async def stream_generate(http: aiohttp.ClientSession, url: str, body: dict,
                          routing_key: str | None = None) -> tuple[float, float, dict]:
    """POST a streamed /generate (routed by `routing_key` behind SGLang's router); (ttft,
    latency, last chunk). Raises on HTTP errors."""
    start = time.perf_counter()
    ttft, last = None, None
    headers = {ROUTING_HEADER: routing_key} if routing_key else None
    async with http.post(url + "/generate", json={**body, "stream": True}, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/generate answered {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if "error" in chunk:
                raise RuntimeError(f"/generate stream error: {chunk['error']}")
            if ttft is None:
                ttft = time.perf_counter() - start
            last = chunk
    if last is None:
        raise RuntimeError("/generate streamed no output")
    return ttft, time.perf_counter() - start, last


def request_body(sim: Simulation, mode: Mode, pieces: list[str], prefill_only: bool = False, round_id: str = "",
                 agent_id: str = "", simulation: str = "", last_round: bool = False) -> dict:
    """A round's prompt from its pieces: marked for TokenDance, which also registers each
    output as next round's block (except in prefill-only sessions, whose next blocks are
    stand-ins); under a mode with rounds, the request names its round `round_id` (of all the
    simulation's agents); under a mode with agents, its agent `agent_id`; under a mode with
    simulations, its `simulation`, ended by the requests of its `last_round`. The options go as
    JSON text in `custom_labels`, which SGLang's router passes on."""
    text = join_pieces(pieces, DEFAULT_SEPARATOR if mode.marked else "")
    max_new = 1 if prefill_only else sim.config.max_new_tokens
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
    options = {"register_output": True} if mode.marked and not prefill_only else {}
    if mode.rounds:
        options |= {"round": round_id, "round_size": len(sim.agents)}
    if mode.agents:
        options |= {"agent": agent_id}
    if mode.simulations:
        options |= {"simulation": simulation, **({"end_simulation": True} if last_round else {})}
    if options:
        body["custom_labels"] = options_label(options)
    return body


def author_body(sim: Simulation, mode: Mode, agent: int, round_index: int, blocks: list[str],
                message: str) -> dict:
    """The author's prompt as plain text (no reuse, so the forest caches the message after it:
    it caches no segment that follows reused KV), then its next message as a shared block and a
    private newline (so the message is not trailing private text); one token asked."""
    pieces = [sim.plain_prompt(agent, round_index, blocks), message, "\n"]
    text = (DEFAULT_SEPARATOR if mode.marked else "").join(pieces)
    return {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


async def run_session(http, url: str, mode: Mode, sim: Simulation, session: int, result: RunResult,
                      progress, prefill_only: bool = False,
                      watch: Callable[[int], ContextManager] | None = None) -> None:
    """One simulation's rounds, every request routed by the simulation's key; `watch(round_index)`
    wraps each timed round (e.g. a profiler)."""
    blocks = list(sim.seed_messages)
    run_id = f"{time.time_ns()}-{session}"  # round and agent ids unique per server, whatever ran on it before
    key = f"sim-{run_id}"
    earlier: list[list[str]] = [[] for _ in sim.agents]  # each agent's conversation so far (config.conversation)
    if sim.config.blocks_cached:
        await cache_blocks(http, url, mode, [*sim.context[0], *blocks], key)
    for round_index in range(sim.config.num_rounds):
        pieces = [sim.round_pieces(a, round_index, blocks, earlier[a]) for a in range(len(sim.agents))]
        last = round_index == sim.config.num_rounds - 1
        bodies = [request_body(sim, mode, pieces[a], prefill_only, f"{run_id}-{round_index}", f"{run_id}-{a}", key,
                               last) for a in range(len(sim.agents))]
        with watch(round_index) if watch else contextlib.nullcontext():
            start = time.perf_counter()
            answers = await asyncio.gather(*(stream_generate(http, url, b, key) for b in bodies),
                                           return_exceptions=True)
            latency = time.perf_counter() - start
        outs = {agent: out for agent, out in enumerate(answers) if not isinstance(out, BaseException)}
        result.errors += [f"round {round_index} agent {agent}: {out!r}" for agent, out in enumerate(answers)
                          if isinstance(out, BaseException)]
        if not outs:
            raise RuntimeError(f"every request of round {round_index} failed: {result.errors[-1]}")
        prefill = max(ttft for ttft, _, _ in outs.values())
        result.rounds.append(RoundRecord(session, round_index, len(sim.agents), start, latency,
                                         prefill, latency - prefill))
        for agent, (ttft, req_latency, last) in outs.items():
            meta = last["meta_info"]
            reuse = meta.get("tokendance") or {}
            result.requests.append(RequestRecord(
                session, round_index, agent, ttft, req_latency, meta["prompt_tokens"],
                meta.get("cached_tokens", 0), meta["completion_tokens"], reuse.get("reused_tokens", 0),
                last["text"], reuse.get("recomputed_tokens", 0), reuse.get("computed_tokens", 0),
                reuse.get("segment_hits", 0), reuse.get("adopted_tokens", 0), reuse.get("mirror_diff_tokens", 0),
                reuse.get("exact_recurring_tokens", 0), reuse.get("agent_prefix_tokens", 0), bodies[agent]["text"],
                list(last.get("output_ids", [])),
            ))
        if prefill_only:
            blocks = await register_stand_ins(http, url, mode, sim, round_index, blocks, key)
        else:
            # a failed agent's message stays what it was (the round goes on without its answer)
            blocks = [message_block(outs[a][2]["text"]) if a in outs else blocks[a] for a in range(len(blocks))]
            earlier = [[*pieces[a], blocks[a]] for a in range(len(blocks))]
        progress.update(1)
        if round_index + 1 < sim.config.num_rounds:
            await asyncio.sleep(sim.config.think_seconds)


async def cache_blocks(http, url: str, mode: Mode, blocks: list[str], routing_key: str) -> None:
    """Untimed: each block sent once on its own (marked for TokenDance, which caches it as a
    segment where it stands; a stock server holds it in its tree), as other requests before the
    simulation would have left them."""
    marker = DEFAULT_SEPARATOR if mode.marked else ""
    bodies = [{"text": f"{marker}{block}{marker}", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
              for block in blocks]
    await asyncio.gather(*(stream_generate(http, url, b, routing_key) for b in bodies))


async def register_stand_ins(http, url: str, mode: Mode, sim: Simulation, round_index: int,
                             blocks: list[str], routing_key: str) -> list[str]:
    """Untimed author prefills of the next round's stand-in messages; returns them."""
    if round_index + 1 == sim.config.num_rounds:
        return blocks
    messages = stand_in_messages(sim.config, round_index + 1)
    bodies = [author_body(sim, mode, j, round_index, blocks, m) for j, m in enumerate(messages)]
    await asyncio.gather(*(stream_generate(http, url, b, routing_key) for b in bodies))
    return messages


async def poll_kv_usage(http, url: str, t0: float, samples: list, interval: float = 0.25) -> None:
    while True:
        try:
            async with http.get(url + "/v1/loads?include=core") as resp:
                loads = (await resp.json())["loads"]
            samples.append((time.perf_counter() - t0, sum(x["num_used_tokens"] for x in loads)))
        except (aiohttp.ClientError, KeyError, ValueError):
            pass
        await asyncio.sleep(interval)


async def run_load(url: str, mode: Mode, config: WorkloadConfig, num_sessions: int,
                   request_rate: float, progress, prefill_only: bool = False,
                   watch: Callable[[int], ContextManager] | None = None) -> RunResult:
    """`num_sessions` simulations (seeds seed, seed+1, ...) arriving at `request_rate`/s; `watch`
    wraps every timed round (run_session)."""
    result = RunResult(mode.name, config.num_agents, request_rate)
    arrivals = random.Random(config.seed)
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
        t0 = result.t0 = time.perf_counter()
        poller = asyncio.create_task(poll_kv_usage(http, url, t0, result.kv_usage))
        tasks = []
        for s in range(num_sessions):
            sim = make_simulation(WorkloadConfig(**{**asdict(config), "seed": config.seed + s}))
            tasks.append(asyncio.create_task(run_session(http, url, mode, sim, s, result, progress, prefill_only,
                                                               watch)))
            if request_rate != float("inf") and s + 1 < num_sessions:
                await asyncio.sleep(arrivals.expovariate(request_rate))
        try:
            await asyncio.gather(*tasks)
        finally:
            poller.cancel()
        result.wall = time.perf_counter() - t0
    result.record_round_peaks()
    return result
