"""`python -m sglang_tokendance.bench_multiagent`: multi-agent rounds, TokenDance vs stock SGLang.

In the style of `python -m sglang.bench_serving`. Without --base-url/--port it starts each
system of --modes itself, one after the other on the same machine, and compares them:
  radix       stock SGLang with its radix prefix cache (prompts without separators)
  no-cache    stock SGLang with --disable-radix-cache
  tokendance  our server (prompts with separators)
With --base-url or --port it drives one running server; --backend says which kind it is.
--capacity finds, per mode and session rate, the most agents whose mean round latency stays
under an SLO at a fixed KV budget (--max-total-tokens). --capacity fit finds instead the most
agents whose rounds past the first fit the budget: every request live at once (each had its
first token before any of them ended, so none queued for another's KV) and none retracted
(SGLang's metrics), whatever the latency -- what binds where decode is cheap (a GPU).
--prefill-only times just the rounds' prefill (one token asked; the next round's messages are
stand-ins registered by untimed author prefills, bench/multiagent.py) at every N of
--num-agents (e.g. 4,8,16), with every mode's server up at once and the modes interleaved, and
reports each mode's prefill time and work (token-layers computed) as fractions of a full
prefill's -- the time measured against stock radix, the work counted from the server's
reused/recomputed tokens.
--workers K runs --num-sessions simulations at once on one worker, then on K workers behind
SGLang's router (sglang-router) under each of --router-policies (manual: every request of a
simulation carries its routing key), and reports the share of prompt tokens served from a
cache against one worker's, how the rounds spread over the workers, latency and throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import requests
from tqdm import tqdm

from sglang_tokendance.bench import report
from sglang_tokendance.bench.capacity import SLO_FACTOR, capacity, capacity_fit
from sglang_tokendance.bench.machine import idle_check
from sglang_tokendance.bench.multiagent import (MODES, Mode, RequestRecord, RunResult)
from sglang_tokendance.core.blend_types import BlendOptions
from sglang_tokendance.core.cost import PrefillCost
from sglang_tokendance.bench.systems import Systems, run, server_argv, warm_up
from sglang_tokendance.bench.workloads import PRESETS, WorkloadConfig

DEFAULT_OUTPUT = Path("benchmark/results/multiagent.jsonl")
SCALE_OUT_MODE = "tokendance-rounds"  # named rounds, one routing key per simulation


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_multiagent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["sglang", "tokendance"], default="tokendance",
                   help="kind of the running server given by --base-url/--port")
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--modes", default=None,
                   help=f"systems to start and compare (from {', '.join(MODES)}; default radix,no-cache,tokendance, "
                        f"with --workers {SCALE_OUT_MODE})")
    p.add_argument("--model-path", default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV budget of started servers")
    p.add_argument("--preset", choices=sorted(PRESETS), default="generative_agents")
    p.add_argument("--num-agents", default=None,
                   help="agents per round; with --prefill-only a comma list of them (default 4,8,16)")
    p.add_argument("--num-rounds", type=int, default=None)
    p.add_argument("--history-words", type=int, default=None)
    p.add_argument("--block-words", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--prefill-only", action="store_true",
                   help="time only the rounds' prefill, at every --num-agents, modes interleaved")
    p.add_argument("--repeats", type=int, default=1, help="--prefill-only: sessions per mode and N")
    p.add_argument("--server-args", default="", help="extra flags for every started server (one string)")
    p.add_argument("--no-permute", action="store_true", help="every agent sees blocks in one order")
    p.add_argument("--conversation", action="store_true",
                   help="each round's prompt extends the agent's previous prompt and answer (compare "
                        "tokendance-mirror with tokendance-kept, which keeps each agent's row for its next round)")
    p.add_argument("--quality", action="store_true",
                   help="send every mode's prompts again to a --disable-tokendance server (a full prefill) and "
                        "report how many greedy outputs are identical to its (bench/full_prefill.py)")
    p.add_argument("--num-sessions", type=int, default=1, help="simulations run concurrently")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="session arrivals per second")
    p.add_argument("--think-seconds", type=float, default=0.0,
                   help="each simulation's pause between its rounds (its world steps): with several sessions, "
                        "the others' rounds run meanwhile and its KV waits in the cache")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", type=Path, default=DEFAULT_OUTPUT,
                   help="JSONL; the Markdown summary and PNG plots are written beside it")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--capacity", nargs="?", const="slo", choices=["slo", "fit"], default=None,
                   help="run a capacity search instead: the most agents under the round-latency SLO (slo, "
                        "the default) or whose rounds fit the KV budget without queueing or retraction (fit)")
    p.add_argument("--capacity-rates", default="0.05,0.2", help="session rates for --capacity")
    p.add_argument("--min-agents", type=int, default=1,
                   help="--capacity: where each search starts (a mode that does not reach it reports one less)")
    p.add_argument("--max-agents", type=int, default=12)
    p.add_argument("--capacity-repeats", type=int, default=1,
                   help="--capacity: searches per mode, the modes' order reversed every other time; "
                        "the reported max agents is the median")
    p.add_argument("--slo-ms", type=float, default=0.0,
                   help=f"round-latency SLO for --capacity; 0 = {SLO_FACTOR}x one agent's round")
    p.add_argument("--workers", type=int, default=0,
                   help="scale-out: run --num-sessions simulations at once on one worker, then on this many "
                        "workers behind SGLang's router under each --router-policies (one mode)")
    p.add_argument("--router-policies", default="manual,cache_aware,round_robin",
                   help="--workers: sglang-router policies; manual routes by each simulation's key")
    args = p.parse_args(argv)
    args.modes = args.modes or (SCALE_OUT_MODE if args.workers else "radix,no-cache,tokendance")
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"unknown mode {unknown[0]!r} (known: {', '.join(MODES)})")
    if not args.think_seconds >= 0:
        p.error(f"--think-seconds must be non-negative, got {args.think_seconds}")
    args.agents = [int(n) for n in (args.num_agents or ("4,8,16" if args.prefill_only else "0")).split(",")]
    if len(args.agents) > 1 and not args.prefill_only:
        p.error("a list of --num-agents needs --prefill-only")
    if args.prefill_only and (args.capacity or args.base_url or args.port):
        p.error("--prefill-only starts its own servers and cannot be combined with --capacity")
    if args.quality and (args.capacity or args.prefill_only or args.base_url or args.port):
        p.error("--quality compares the modes this command starts, without --capacity or --prefill-only")
    if args.workers and (args.workers < 2 or "," in args.modes or args.capacity or args.quality
                         or args.base_url or args.port):
        p.error("--workers needs at least 2 workers, one mode, and starts its own servers (without --capacity "
                "or --quality)")
    if args.capacity == "fit" and args.num_sessions != 1:
        p.error("--capacity fit runs one simulation at a time (--num-sessions 1)")
    if not 1 <= args.min_agents <= args.max_agents:
        p.error(f"--min-agents must be within 1..--max-agents, got {args.min_agents}")
    if args.capacity_repeats < 1:
        p.error(f"--capacity-repeats must be at least 1, got {args.capacity_repeats}")
    return args


def workload_config(args) -> WorkloadConfig:
    overrides = {
        "num_agents": args.agents[0] or None, "num_rounds": args.num_rounds, "history_words": args.history_words,
        "block_words": args.block_words, "max_new_tokens": args.max_new_tokens,
    }
    config = replace(PRESETS[args.preset], seed=args.seed, permute=not args.no_permute, conversation=args.conversation,
                     think_seconds=args.think_seconds)
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})


def compare(args, systems: Systems, config: WorkloadConfig) -> tuple[list[dict], list[tuple[str, str]]]:
    records, results, idles = [], [], []
    for mode in systems.modes():
        with systems.serve(mode) as server:
            warm_up(mode, server.url, config)
            idles.append({"mode": mode.name, **idle_check()})
            result = run(mode, server.url, config, args.num_sessions, args.request_rate, mode.name)
        results.append(result)
        records += [{"type": "request", "mode": mode.name, **asdict(r)} for r in result.requests]
        records += [{"type": "round", "mode": mode.name, **asdict(r)} for r in result.rounds]
        records += [{"type": "kv", "mode": mode.name, "t": t, "used_tokens": u} for t, u in result.kv_usage]
    summaries = with_ratios([r.summary() for r in results])
    records += [{"type": "idle", **i} for i in idles] + [{"type": "summary", **s} for s in summaries]
    speedup = next(k for k in summaries[0] if k.startswith("round_speedup_vs_"))
    def by_round(key: str) -> list[dict]:
        return [{"mode": s["mode"], **{f"round {k}": v for k, v in s[key].items()}} for s in summaries]

    sections = [
        ("Machine idle before each timed mode", report.markdown_table(idles, ["mode", "cpu_busy_fraction", "idle"])),
        ("Summary", report.markdown_table(summaries, [
            "mode", speedup, "mean_round_latency_s", "mean_round_prefill_s", "mean_round_decode_s",
            "mean_ttft_s", "prompt_tokens", "cached_tokens", "reused_tokens", "peak_kv_used_tokens",
            "peak_kv_tokens_per_agent", "mirror_compression", "wall_s"])),
        ("Tail latency and errors", report.markdown_table(summaries, [
            "mode", "num_requests", "errors", "p50_ttft_s", "p99_ttft_s", "p50_round_latency_s",
            "p99_round_latency_s"])),
        *((title, report.markdown_table(rows, list(rows[0]))) for title, rows in (
            ("Mean round latency by round (s)", by_round("round_latency_by_round_s")),
            ("Mean round prefill by round (s)", by_round("round_prefill_by_round_s")),
            ("Prompt tokens computed by round", by_round("computed_tokens_by_round")),
            ("Prompt tokens served exactly from the radix tree (cached_tokens) by round",
             by_round("cached_tokens_by_round")),
            ("Prompt tokens reused approximately (kept, not recomputed) by round",
             by_round("reused_tokens_by_round")))),
    ]
    if args.quality:
        rows = full_prefill_agreement(args, config, results)
        records += [{"type": "full_prefill_agreement", **r} for r in rows]
        sections.append(("Greedy outputs against a full prefill of the same prompts (bench/full_prefill.py)",
                         report.markdown_table(rows, ["mode", "requests", "identical", "identical_fraction",
                                                      "mean_common_prefix_tokens", "mean_common_prefix_share",
                                                      "same_prompt_lengths", "reused_share"])))
        by_round_rows = [{"mode": r["mode"], **{f"round {k}": v for k, v in r["identical_fraction_by_round"].items()}}
                         for r in rows]
        sections.append(("Identical to the full prefill, by round", report.markdown_table(
            by_round_rows, list(by_round_rows[0]))))
        if not args.no_plot:
            report.plot_lines(Path(f"{args.output_file.with_suffix('')}_full_prefill_agreement.png"),
                              "Greedy outputs identical to a full prefill's", "round", "fraction of requests",
                              {r["mode"]: (list(r["identical_fraction_by_round"]),
                                           list(r["identical_fraction_by_round"].values())) for r in rows})
    if not args.no_plot:
        stem = args.output_file.with_suffix("")
        for name, title, key in (("round_latency", "Round latency", "round_latency_by_round_s"),
                                 ("round_prefill", "Round prefill", "round_prefill_by_round_s")):
            report.plot_lines(Path(f"{stem}_{name}.png"), title, "round", "seconds",
                              {s["mode"]: (list(s[key]), list(s[key].values())) for s in summaries})
        report.plot_lines(Path(f"{stem}_kv_usage.png"), "KV cache in use", "seconds", "tokens",
                          {r.mode: ([t for t, _ in r.kv_usage], [u for _, u in r.kv_usage]) for r in results})
    return records, sections


def full_prefill_agreement(args, config: WorkloadConfig, results: list[RunResult]) -> list[dict]:
    """Every mode's requests sent again to one --disable-tokendance server (a full prefill)."""
    from sglang_tokendance.bench.full_prefill import agreement, replay
    from sglang_tokendance.bench.server_process import ServerProcess

    rows = []
    with ServerProcess([*server_argv(args, MODES["radix"]), "--disable-tokendance"]) as reference:
        for result in results:
            with tqdm(total=len(result.requests), desc=f"full prefill of {result.mode}'s prompts",
                      unit="request") as progress:
                answers = replay(reference.url, result.requests, config.max_new_tokens, progress)
            rows.append(agreement(result.mode, result.requests, answers))
    return rows


def with_ratios(summaries: list[dict]) -> list[dict]:
    """Round speedup of every mode against stock radix (or the first mode without it)."""
    baseline = next((s for s in summaries if s["mode"] == "radix"), summaries[0])
    key = "round_speedup_vs_" + baseline["mode"]
    return [{**s, key: baseline["mean_round_latency_s"] / s["mean_round_latency_s"]} for s in summaries]


PROMPT_BLOCK_WORDS = 480  # --prefill-only: N blocks of 480/N words, prompts of ~800 tokens at any N


def token_layers(record: RequestRecord, options: BlendOptions | None, num_layers: int) -> int:
    """Token-layers the forward computed for one request's prompt past its radix prefix: the
    blended prefill's stages (core/cost) with the reused tokens it really recomputed and adopted
    (token granularity, no head tokens; the adopted kept ones taken in proportion to the adopted
    share); without a blended prefill, every fresh token through every layer."""
    reused = record.reused_tokens + record.recomputed_tokens
    tokens = record.prompt_tokens - record.cached_tokens
    if options is None:
        return (tokens - reused) * num_layers
    stages = PrefillCost(num_layers, options, attention_mass=False).stages(
        tokens, reused, kept=record.recomputed_tokens, adopted=record.adopted_tokens)
    return sum(stage.layers * stage.tokens for stage in stages)


def model_layers(model_path: str | None) -> int:
    from sglang_tokendance.model_store import prepared_default_model

    config = json.loads((Path(model_path or prepared_default_model()) / "config.json").read_text())
    return config["num_hidden_layers"]


def prefill_sweep(args, systems: Systems, config: WorkloadConfig) -> tuple[list[dict], list[tuple[str, str]]]:
    """Prefill-only sessions at every N of --num-agents, interleaved over the modes' servers."""
    from sglang_tokendance.bench.server_process import flush_cache

    modes, layers = systems.modes(), model_layers(args.model_path)
    results: dict[tuple[str, int], list[RunResult]] = {}
    records, idles = [], []
    with contextlib.ExitStack() as stack:
        urls = {m.name: stack.enter_context(systems.serve(m)).url for m in modes}
        for m in modes:
            warm_up(m, urls[m.name], replace(config, num_agents=2, num_rounds=2), prefill_only=True)
        for rep in range(args.repeats):
            for n in args.agents:
                words = args.block_words or max(1, round(PROMPT_BLOCK_WORDS / n))
                session = replace(config, num_agents=n, block_words=words, seed=config.seed + rep)
                idles.append({"repeat": rep, "num_agents": n, **idle_check()})
                for m in modes:
                    flush_cache(urls[m.name])
                    result = run(m, urls[m.name], session, 1, float("inf"), f"{m.name} N={n} #{rep}", True)
                    results.setdefault((m.name, n), []).append(result)
                    records += [{"type": "request", "mode": m.name, "repeat": rep, **asdict(r)}
                                for r in result.requests]
                    records += [{"type": "round", "mode": m.name, "repeat": rep, **asdict(r)} for r in result.rounds]
    rows = prefill_rows(modes, args.agents, results, layers)
    records += [{"type": "idle", **i} for i in idles] + [{"type": "prefill_summary", **r} for r in rows]
    if not args.no_plot:
        stem = args.output_file.with_suffix("")
        report.plot_fractions(Path(f"{stem}_fractions.png"), rows)
        report.plot_lines(Path(f"{stem}_speedup.png"), "Prefill of rounds with reuse: speedup over stock radix",
                          "agents per round (N)", "radix's time / the mode's",
                          {m.name: ([r["num_agents"] for r in rows if r["mode"] == m.name],
                                    [r["speedup"] for r in rows if r["mode"] == m.name]) for m in modes})
    columns = ["mode", "num_agents", "time_fraction", "speedup", "work_fraction", "mean_prefill_s",
               "round0_time_fraction", "prompt_tokens", "cached_tokens", "reused_tokens", "recomputed_tokens"]
    return records, [("Machine idle before each N", report.markdown_table(idles, ["repeat", "num_agents",
                                                                                   "cpu_busy_fraction", "idle"])),
                     ("Prefill of the rounds with reuse (rounds 1 on), as fractions of stock radix's time and "
                      "of a full prefill's token-layers", report.markdown_table(rows, columns))]


def prefill_rows(modes: list[Mode], agents: list[int], results: dict[tuple[str, int], list[RunResult]],
                 layers: int) -> list[dict]:
    """Per mode and N: mean prefill time of the rounds after the first (which have reuse) and
    of round 0 (none yet), both over radix's (and the speedup, its inverse), and the work
    fraction of those rounds."""
    def mean_prefill(name: str, n: int, later: bool) -> float:
        times = [r.prefill for res in results[(name, n)] for r in res.rounds if (r.round > 0) == later]
        return sum(times) / len(times)

    rows = []
    for n in agents:
        base = "radix" if ("radix", n) in results else modes[0].name
        for m in modes:
            reqs = [q for res in results[(m.name, n)] for q in res.requests if q.round > 0]
            options = m.blend_options()
            full = sum((q.prompt_tokens - q.cached_tokens) * layers for q in reqs)
            fraction = mean_prefill(m.name, n, True) / mean_prefill(base, n, True)
            rows.append({
                "mode": m.name, "num_agents": n, "time_fraction": fraction, "speedup": 1 / fraction,
                "work_fraction": sum(token_layers(q, options, layers) for q in reqs) / full,
                "mean_prefill_s": mean_prefill(m.name, n, True),
                "round0_time_fraction": mean_prefill(m.name, n, False) / mean_prefill(base, n, False),
                "prompt_tokens": sum(q.prompt_tokens for q in reqs),
                "cached_tokens": sum(q.cached_tokens for q in reqs),
                "reused_tokens": sum(q.reused_tokens for q in reqs),
                "recomputed_tokens": sum(q.recomputed_tokens for q in reqs),
            })
    return rows


def scale_out(args, systems: Systems, config: WorkloadConfig) -> tuple[list[dict], list[tuple[str, str]]]:
    """--num-sessions simulations at once on one worker, then on --workers workers behind SGLang's
    router under each policy, the workers emptied before each; reuse against one worker's. Every
    worker has cores // K threads, so one worker uses 1/K of the machine: workers add hardware,
    as GPUs would."""
    from sglang_tokendance.bench.router_process import RouterProcess
    from sglang_tokendance.bench.server_process import flush_cache

    (mode,) = systems.modes()
    # each worker its share of the cores (torch would give every worker all of them, and K workers'
    # threads on the same cores slow each other down several times over)
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.workers))}
    setups = [("1 worker", "")] + [(f"{args.workers} workers, {p}", p) for p in args.router_policies.split(",")]
    records, rows, results = [], [], []
    with contextlib.ExitStack() as stack:
        workers = [systems.serve(mode, threads) for _ in range(args.workers)]  # started together
        for worker in workers:
            stack.enter_context(worker)
        for worker in workers:
            warm_up(mode, worker.url, config, args.prefill_only)
        for name, policy in setups:
            for worker in workers:
                flush_cache(worker.url)
            before = [rounds_formed(w.url) for w in workers]
            front = RouterProcess([w.url for w in workers], policy) if policy else contextlib.nullcontext(workers[0])
            with front as entry:
                idle = idle_check()
                result = run(mode, entry.url, config, args.num_sessions, args.request_rate, name,
                             args.prefill_only)
            spread = [rounds_formed(w.url) - b for w, b in zip(workers, before)]
            rows.append(scale_out_row(name, result, spread, idle))
            results.append((name, result))
            records += [{"type": "request", "setup": name, **asdict(r)} for r in result.requests]
            records += [{"type": "round", "setup": name, **asdict(r)} for r in result.rounds]
    for row in rows:
        row["reuse_vs_1_worker"] = row["reuse_share"] / rows[0]["reuse_share"] if rows[0]["reuse_share"] else 0.0
    records += [{"type": "scale_out", **r} for r in rows]
    if not args.no_plot:
        by_round = {name: reuse_share_by_round(r) for name, r in results}
        latency = {name: r.summary()["round_latency_by_round_s"] for name, r in results}
        report.plot_panels(Path(f"{args.output_file.with_suffix('')}_scale_out.png"),
                           f"{args.num_sessions} simulations, {mode.name}", [
            report.Panel("Prompt tokens served from a cache", "round", "share of prompt tokens",
                         {k: (list(v), list(v.values())) for k, v in by_round.items()}),
            report.Panel("Round latency", "round", "seconds",
                         {k: (list(v), list(v.values())) for k, v in latency.items()})])
    return records, [("Scale-out behind SGLang's router", report.markdown_table(rows, [
        "setup", "reuse_share", "reuse_vs_1_worker", "segment_hits", "exact_cached_tokens", "prompt_tokens",
        "rounds_per_worker", "mean_round_latency_s", "completion_tokens_per_s", "errors", "idle"]))]


def rounds_formed(url: str) -> int:
    info = requests.get(url + "/server_info", timeout=60).json()["internal_states"][0]
    return info["tokendance_rounds"]["rounds_formed"]


def served_from_cache(r: RequestRecord) -> int:
    """Prompt tokens not computed from scratch: the radix tree's exact prefix, segments' KV."""
    return r.cached_tokens + r.reused_tokens + r.recomputed_tokens


def reuse_share_by_round(result: RunResult) -> dict[int, float]:
    rounds = sorted({r.round for r in result.requests})
    mine = {k: [r for r in result.requests if r.round == k] for k in rounds}
    return {k: sum(map(served_from_cache, v)) / max(1, sum(r.prompt_tokens for r in v)) for k, v in mine.items()}


def scale_out_row(name: str, result: RunResult, spread: list[int], idle: dict) -> dict:
    summary = result.summary()
    served = sum(map(served_from_cache, result.requests))
    return {"setup": name, "reuse_share": served / max(1, summary["prompt_tokens"]),
            "segment_hits": sum(r.segment_hits for r in result.requests),
            "exact_cached_tokens": summary["cached_tokens"], "prompt_tokens": summary["prompt_tokens"],
            "rounds_per_worker": "/".join(map(str, spread)), "mean_round_latency_s": summary["mean_round_latency_s"],
            "completion_tokens_per_s": summary["completion_tokens"] / summary["wall_s"],
            "errors": summary["errors"], "idle": idle["idle"], "wall_s": summary["wall_s"]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    config = workload_config(args)
    systems = Systems(args)
    command = report.command_line("sglang_tokendance.bench_multiagent", argv)
    records, sections = (scale_out if args.workers else prefill_sweep if args.prefill_only
                         else capacity_fit if args.capacity == "fit" else capacity if args.capacity
                         else compare)(args, systems, config)
    meta = {"type": "meta", "command": command, "workload": asdict(config), "num_sessions": args.num_sessions,
            "request_rate": args.request_rate, "max_total_tokens": args.max_total_tokens}
    report.write_jsonl(args.output_file, [meta, *records])
    workload = report.markdown_table([asdict(config)], list(asdict(config)))
    md = args.output_file.with_suffix(".md")
    report.write_markdown(md, "Multi-agent rounds", command, [("Workload", workload), *sections])
    print(md.read_text())


if __name__ == "__main__":
    main()
