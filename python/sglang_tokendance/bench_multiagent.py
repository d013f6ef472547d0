"""`python -m sglang_tokendance.bench_multiagent`: multi-agent rounds, TokenDance vs stock SGLang.

In the style of `python -m sglang.bench_serving`. Without --base-url/--port it starts each
system of --modes itself, one after the other on the same machine, and compares them:
  radix       stock SGLang with its radix prefix cache (prompts without separators)
  no-cache    stock SGLang with --disable-radix-cache
  tokendance  our server (prompts with separators)
With --base-url or --port it drives one running server; --backend says which kind it is.
--capacity finds, per mode and session rate, the most agents whose mean round latency stays
under an SLO at a fixed KV budget (--max-total-tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from sglang_tokendance.bench import report
from sglang_tokendance.bench.machine import idle_check
from sglang_tokendance.bench.multiagent import MODES, Mode, RunResult, run_load
from sglang_tokendance.bench.workloads import PRESETS, WorkloadConfig

DEFAULT_OUTPUT = Path("benchmark/results/multiagent.jsonl")
SLO_FACTOR = 3.0  # auto SLO: a round may take 3x as long as one agent's round alone


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_multiagent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["sglang", "tokendance"], default="tokendance",
                   help="kind of the running server given by --base-url/--port")
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--modes", default="radix,no-cache,tokendance",
                   help=f"systems to start and compare (from {', '.join(MODES)})")
    p.add_argument("--model-path", default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV budget of started servers")
    p.add_argument("--preset", choices=sorted(PRESETS), default="generative_agents")
    p.add_argument("--num-agents", type=int, default=None)
    p.add_argument("--num-rounds", type=int, default=None)
    p.add_argument("--history-words", type=int, default=None)
    p.add_argument("--block-words", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--no-permute", action="store_true", help="every agent sees blocks in one order")
    p.add_argument("--num-sessions", type=int, default=1, help="simulations run concurrently")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="session arrivals per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", type=Path, default=DEFAULT_OUTPUT,
                   help="JSONL; the Markdown summary and PNG plots are written beside it")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--capacity", action="store_true", help="run the capacity search instead")
    p.add_argument("--capacity-rates", default="0.05,0.2", help="session rates for --capacity")
    p.add_argument("--max-agents", type=int, default=12)
    p.add_argument("--slo-ms", type=float, default=0.0,
                   help=f"round-latency SLO for --capacity; 0 = {SLO_FACTOR}x one agent's round")
    args = p.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"unknown mode {unknown[0]!r} (known: {', '.join(MODES)})")
    return args


def workload_config(args) -> WorkloadConfig:
    overrides = {
        "num_agents": args.num_agents, "num_rounds": args.num_rounds, "history_words": args.history_words,
        "block_words": args.block_words, "max_new_tokens": args.max_new_tokens,
    }
    config = replace(PRESETS[args.preset], seed=args.seed, permute=not args.no_permute)
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})


def server_argv(args, mode: Mode) -> list[str]:
    argv = list(mode.server_args)
    if args.model_path:
        argv += ["--model-path", args.model_path]
    if args.max_total_tokens:
        argv += ["--max-total-tokens", str(args.max_total_tokens)]
    return argv


class Systems:
    """The compared systems: started one at a time, or the one running server."""

    def __init__(self, args):
        self.args = args
        if args.base_url or args.port:
            url = args.base_url or f"http://{args.host}:{args.port}"
            backend = MODES["tokendance" if args.backend == "tokendance" else "radix"]
            self.running = (replace(backend, name=args.backend), url.rstrip("/"))
        else:
            self.running = None

    def modes(self) -> list[Mode]:
        return [self.running[0]] if self.running else [MODES[m] for m in self.args.modes.split(",")]

    def serve(self, mode: Mode):
        if self.running:
            return _Running(self.running[1])
        from sglang_tokendance.server_process import ServerProcess

        return ServerProcess(server_argv(self.args, mode), stock=mode.stock)


class _Running:
    def __init__(self, url: str):
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def run(mode: Mode, url: str, config: WorkloadConfig, sessions: int, rate: float, label: str) -> RunResult:
    with tqdm(total=sessions * config.num_rounds, desc=label, unit="round") as progress:
        return asyncio.run(run_load(url, mode, config, sessions, rate, progress))


def warm_up(mode: Mode, url: str, config: WorkloadConfig) -> None:
    """One small round first, so no mode pays one-off start-up costs inside the timing."""
    run(mode, url, replace(config, num_agents=1, num_rounds=1, seed=config.seed + 10_000), 1, float("inf"),
        f"{mode.name} warm-up")


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
    by_round = [{"mode": s["mode"], **{f"round {k}": v for k, v in s["round_latency_by_round_s"].items()}}
                for s in summaries]
    sections = [
        ("Machine idle before each timed mode", report.markdown_table(idles, ["mode", "cpu_busy_fraction", "idle"])),
        ("Summary", report.markdown_table(summaries, [
            "mode", speedup, "mean_round_latency_s", "mean_round_prefill_s", "mean_round_decode_s",
            "mean_ttft_s", "prompt_tokens", "cached_tokens", "reused_tokens", "peak_kv_used_tokens", "wall_s"])),
        ("Mean round latency by round (s)", report.markdown_table(by_round, list(by_round[0]))),
    ]
    if not args.no_plot:
        stem = args.output_file.with_suffix("")
        report.plot_lines(Path(f"{stem}_round_latency.png"), "Round latency", "round", "seconds",
                          {s["mode"]: (list(s["round_latency_by_round_s"]), list(s["round_latency_by_round_s"].values()))
                           for s in summaries})
        report.plot_lines(Path(f"{stem}_kv_usage.png"), "KV cache in use", "seconds", "tokens",
                          {r.mode: ([t for t, _ in r.kv_usage], [u for _, u in r.kv_usage]) for r in results})
    return records, sections


def with_ratios(summaries: list[dict]) -> list[dict]:
    """Round speedup of every mode against stock radix (or the first mode without it)."""
    baseline = next((s for s in summaries if s["mode"] == "radix"), summaries[0])
    key = "round_speedup_vs_" + baseline["mode"]
    return [{**s, key: baseline["mean_round_latency_s"] / s["mean_round_latency_s"]} for s in summaries]


def capacity(args, systems: Systems, config: WorkloadConfig) -> tuple[list[dict], list[tuple[str, str]]]:
    """Most agents per mode and session rate whose mean round latency stays under the SLO."""
    rates = [float(r) for r in args.capacity_rates.split(",")]
    records, table, latency_series, agents_series = [], [], {}, {}
    slo = args.slo_ms / 1000 if args.slo_ms else None
    for mode in systems.modes():
        with systems.serve(mode) as server:
            warm_up(mode, server.url, config)
            if slo is None:
                alone = run(mode, server.url, replace(config, num_agents=1), 1, float("inf"), "SLO probe")
                slo = SLO_FACTOR * alone.summary()["mean_round_latency_s"]
                records.append({"type": "slo", "mode": mode.name, "slo_s": slo, "factor": SLO_FACTOR})
            best_by_rate = []
            for rate in rates:
                best, curve = 0, []
                for n in range(1, args.max_agents + 1):
                    result = run(mode, server.url, replace(config, num_agents=n), args.num_sessions, rate,
                                 f"{mode.name} rate={rate} agents={n}")
                    summary = result.summary()
                    records.append({"type": "capacity_probe", "slo_s": slo, **summary})
                    curve.append((n, summary["mean_round_latency_s"]))
                    if summary["mean_round_latency_s"] > slo:
                        break
                    best = n
                best_by_rate.append(best)
                table.append({"mode": mode.name, "rate": rate, "max_agents": best, "slo_s": slo})
                if rate == rates[0]:
                    latency_series[mode.name] = ([n for n, _ in curve], [lat for _, lat in curve])
            agents_series[mode.name] = (rates, best_by_rate)
    records += [{"type": "capacity", **row} for row in table]
    if not args.no_plot:
        stem = args.output_file.with_suffix("")
        report.plot_lines(Path(f"{stem}_capacity_latency.png"), f"Round latency at {rates[0]} sessions/s",
                          "agents", "seconds", latency_series, hline=slo, hline_label="SLO")
        report.plot_lines(Path(f"{stem}_capacity_agents.png"), "Most agents under the SLO",
                          "sessions per second", "agents", agents_series)
    return records, [("Capacity", report.markdown_table(table, ["mode", "rate", "max_agents", "slo_s"]))]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    config = workload_config(args)
    systems = Systems(args)
    command = report.command_line("sglang_tokendance.bench_multiagent", argv)
    records, sections = (capacity if args.capacity else compare)(args, systems, config)
    meta = {"type": "meta", "command": command, "workload": asdict(config), "num_sessions": args.num_sessions,
            "request_rate": args.request_rate, "max_total_tokens": args.max_total_tokens}
    report.write_jsonl(args.output_file, [meta, *records])
    workload = report.markdown_table([asdict(config)], list(asdict(config)))
    md = args.output_file.with_suffix(".md")
    report.write_markdown(md, "Multi-agent rounds", command, [("Workload", workload), *sections])
    print(md.read_text())


if __name__ == "__main__":
    main()
