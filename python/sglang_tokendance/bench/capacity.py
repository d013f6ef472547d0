"""bench_multiagent --capacity: the most agents each system serves at a fixed KV budget, under a
round-latency SLO (the default) or (`--capacity fit`) with every request of a round live at
once and none retracted.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Callable

from sglang_tokendance.bench import report
from sglang_tokendance.bench.machine import idle_check
from sglang_tokendance.bench.multiagent import (RetractionWatch, RunResult, all_live_at_once,
                                                mirror_compression)
from sglang_tokendance.bench.systems import Systems, mode_orders, run, warm_up
from sglang_tokendance.bench.workloads import WorkloadConfig

SLO_FACTOR = 3.0  # auto SLO: a round may take 3x as long as one agent's round alone


def capacity(args, systems: Systems, config: WorkloadConfig) -> tuple[list[dict], list[tuple[str, str]]]:
    """Most agents per mode and session rate whose mean round latency stays under the SLO
    (the median over --capacity-repeats searches), with what stopped each search: the KV
    budget (the first failing probe's round did not fit it, fit_probe) or compute (it fitted)."""
    from sglang_tokendance.bench.server_process import flush_cache

    rates = [float(r) for r in args.capacity_rates.split(",")]
    records, found, latency_series = [], {}, {}
    slo = args.slo_ms / 1000 if args.slo_ms else None
    for repeat, modes in enumerate(mode_orders(systems.modes(), args.capacity_repeats)):
        for mode in modes:
            with systems.serve(mode) as server:
                warm_up(mode, server.url, config)
                records.append({"type": "idle", "repeat": repeat, "mode": mode.name, **idle_check()})
                if slo is None:
                    alone = run(mode, server.url, replace(config, num_agents=1), 1, float("inf"), "SLO probe")
                    slo = SLO_FACTOR * alone.summary()["mean_round_latency_s"]
                    records.append({"type": "slo", "mode": mode.name, "slo_s": slo, "factor": SLO_FACTOR})
                for rate in rates:
                    probes = []

                    def holds(n: int) -> bool:
                        flush_cache(server.url)  # each probe as on a fresh server: no earlier probe's KV
                        watch = RetractionWatch(server.url)
                        result = run(mode, server.url, replace(config, num_agents=n), args.num_sessions, rate,
                                     f"{mode.name} #{repeat} rate={rate} agents={n}", watch=watch)
                        fit, summary = fit_probe(result, watch.by_round), result.summary()
                        probes.append({"type": "capacity_probe", "repeat": repeat, "slo_s": slo, **summary,
                                       "under_slo": summary["mean_round_latency_s"] <= slo,
                                       **{k: fit[k] for k in ("fits", "peak_kv_tokens_per_agent",
                                                              "mirror_compression")}})
                        return probes[-1]["under_slo"]

                    best = most_agents(args.min_agents, args.max_agents, holds)
                    records += probes
                    found.setdefault((mode.name, rate), []).append((best, probes))
                    if rate == rates[0]:
                        label = mode.name if args.capacity_repeats == 1 else f"{mode.name} #{repeat}"
                        latency_series[label] = ([p["num_agents"] for p in probes],
                                                 [p["mean_round_latency_s"] for p in probes])
    table = [{"mode": mode, "rate": rate, **searched(searches),
              "stopped_by": ", ".join(what_stopped(probes) for _, probes in searches), "slo_s": slo,
              **means_at_best(searches, ("peak_kv_tokens_per_agent", "mirror_compression"))}
             for (mode, rate), searches in found.items()]
    versus = versus_baseline(table)
    records += [{"type": "capacity", **row} for row in table]
    if not args.no_plot:
        stem = args.output_file.with_suffix("")
        report.plot_lines(Path(f"{stem}_capacity_latency.png"), f"Round latency at {rates[0]} sessions/s",
                          "agents", "seconds", latency_series, hline=slo, hline_label="SLO")
        report.plot_lines(Path(f"{stem}_capacity_agents.png"), "Most agents under the SLO (median)",
                          "sessions per second", "agents",
                          {mode.name: (rates, [statistics.median(best for best, _ in found[mode.name, rate])
                                               for rate in rates]) for mode in systems.modes()})
    columns = ["mode", "rate", "max_agents", "per_repeat", versus, "stopped_by", "slo_s", "peak_kv_tokens_per_agent",
               "mirror_compression"]
    idles = [r for r in records if r["type"] == "idle"]
    return records, [("Capacity", report.markdown_table(table, columns)),
                     ("Machine idle before each search", report.markdown_table(
                         idles, ["repeat", "mode", "cpu_busy_fraction", "idle"]))]


def searched(searches: list[tuple[int, list[dict]]]) -> dict:
    """The median of the searches' most agents, and each search's."""
    return {"max_agents": statistics.median(best for best, _ in searches),
            "per_repeat": ", ".join(str(best) for best, _ in searches)}


def means_at_best(searches: list[tuple[int, list[dict]]], keys: tuple[str, ...]) -> dict:
    """The mean of each key over the probes at each search's most agents (nan: none held)."""
    at_best = [p for best, probes in searches for p in probes if p["num_agents"] == best]
    return {key: statistics.mean(p[key] for p in at_best) if at_best else float("nan") for key in keys}


def what_stopped(probes: list[dict]) -> str:
    """What ended an SLO search: "memory" where the first probe over the SLO did not fit the KV
    budget (its round queued or was retracted for KV), "compute" where it did, "none" where
    every probe held."""
    return next(("compute" if p["fits"] else "memory" for p in probes if not p["under_slo"]), "none")


def versus_baseline(table: list[dict]) -> str:
    """Adds each row's max_agents over radix's (or the first row's) as agents_vs_<mode>; returns
    that column's name."""
    baseline = next((row for row in table if row["mode"] == "radix"), table[0])
    column = "agents_vs_" + baseline["mode"]
    for row in table:
        row[column] = row["max_agents"] / baseline["max_agents"] if baseline["max_agents"] else float("nan")
    return column


def most_agents(min_agents: int, max_agents: int, holds: Callable[[int], bool]) -> int:
    """The largest n in min_agents..max_agents below the first at which `holds(n)` fails
    (min_agents - 1: not even the first)."""
    best = min_agents - 1
    for n in range(min_agents, max_agents + 1):
        if not holds(n):
            break
        best = n
    return best


def fit_probe(result: RunResult, retracted: dict[int, int]) -> dict:
    """Whether one simulation's rounds past the first (its only round when it has one) fit the
    KV budget: every request of the round live at once and none retracted while it ran; with
    the round's peak KV in use per agent and the per-Mirror compression over those rounds."""
    steady = {r.round for r in result.rounds if r.round > 0} or {0}
    requests_of = {k: [q for q in result.requests if q.round == k] for k in steady}
    rounds = [r for r in result.rounds if r.round in steady]
    steady_requests = [q for k in steady for q in requests_of[k]]
    live = all(all_live_at_once(requests_of[k]) for k in steady)
    retractions = sum(retracted.get(k, 0) for k in steady)
    return {"mode": result.mode, "num_agents": result.num_agents, "all_live": live, "retracted": retractions,
            "errors": len(result.errors), "fits": live and not retractions and not result.errors,
            "peak_kv_used_tokens": max(r.peak_kv_tokens for r in rounds),
            "peak_kv_tokens_per_agent": statistics.mean(r.peak_kv_tokens / r.num_agents for r in rounds),
            "mirror_compression": mirror_compression(steady_requests),
            "mean_round_latency_s": statistics.mean(r.latency for r in rounds),
            # the round's shape, for projections (bench_projection)
            "prompt_tokens_per_agent": statistics.mean(q.prompt_tokens for q in steady_requests),
            "reused_positions_per_agent": statistics.mean(q.reused_tokens + q.recomputed_tokens
                                                          for q in steady_requests),
            "completion_tokens_per_agent": statistics.mean(q.completion_tokens for q in steady_requests)}


def capacity_fit(args, systems: Systems, config: WorkloadConfig) -> tuple[list[dict], list[tuple[str, str]]]:
    """Most agents per mode whose rounds fit the KV budget (fit_probe; the median over
    --capacity-repeats searches, the modes' order reversed every other time), with each
    mode's per-agent KV at the round's peak at the most agents it fitted."""
    from sglang_tokendance.bench.server_process import flush_cache

    records, found, curves = [], {}, {}
    for repeat, modes in enumerate(mode_orders(systems.modes(), args.capacity_repeats)):
        for mode in modes:
            with systems.serve(mode) as server:
                warm_up(mode, server.url, config)
                records.append({"type": "idle", "repeat": repeat, "mode": mode.name, **idle_check()})
                probes = []

                def holds(n: int) -> bool:
                    flush_cache(server.url)  # each probe as on a fresh server: no earlier probe's KV
                    watch = RetractionWatch(server.url)
                    result = run(mode, server.url, replace(config, num_agents=n), 1, float("inf"),
                                 f"{mode.name} #{repeat} agents={n}", watch=watch)
                    probes.append(fit_probe(result, watch.by_round))
                    return probes[-1]["fits"]

                best = most_agents(args.min_agents, args.max_agents, holds)
                records += [{"type": "fit_probe", "repeat": repeat, **p} for p in probes]
                found.setdefault(mode.name, []).append((best, probes))
                curves.setdefault(mode.name, probes)
    budget = args.max_total_tokens
    table = [{"mode": name, **searched(searches), "budget_tokens": budget,
              **means_at_best(searches, ("peak_kv_tokens_per_agent", "mirror_compression", "mean_round_latency_s"))}
             for name, searches in found.items()]
    versus = versus_baseline(table)
    records += [{"type": "capacity_fit", **row} for row in table]
    if not args.no_plot:
        report.plot_panels(Path(f"{args.output_file.with_suffix('')}_capacity_fit.png"),
                           f"Rounds past the first at {budget} KV tokens (first search)", [
            report.Panel("Peak KV in use", "agents", "tokens",
                         {m: ([p["num_agents"] for p in c], [p["peak_kv_used_tokens"] for p in c])
                          for m, c in curves.items()}, hline=budget, hline_label="budget"),
            report.Panel("Peak KV in use per agent", "agents", "tokens",
                         {m: ([p["num_agents"] for p in c], [p["peak_kv_tokens_per_agent"] for p in c])
                          for m, c in curves.items()})])
    columns = ["mode", "max_agents", "per_repeat", versus, "budget_tokens",
               "peak_kv_tokens_per_agent", "mirror_compression", "mean_round_latency_s"]
    idles = [r for r in records if r["type"] == "idle"]
    return records, [("Most agents whose rounds fit the KV budget", report.markdown_table(table, columns)),
                     ("Machine idle before each search", report.markdown_table(
                         idles, ["repeat", "mode", "cpu_busy_fraction", "idle"]))]
