"""`python -m sglang_tokendance.bench_profile`: where one prefill round's time goes, per mode.

Starts each mode's server (bench/multiagent.py's MODES) and runs one prefill-only All-Gather
session (bench_multiagent --prefill-only's rounds); py-spy samples the scheduler process
during the timed rounds after the first (those that reuse), and the samples are sorted into
operations and blended-prefill phases (bench/profiling.py). Writes a Markdown breakdown and
the raw collapsed stacks and the run summary beside it; `--render` rebuilds the Markdown from
those (after a change of categories) without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from sglang_tokendance.bench import report
from sglang_tokendance.bench.machine import idle_check
from sglang_tokendance.bench.multiagent import MODES, RunResult, run_session
from sglang_tokendance.bench.profiling import OPERATIONS, PHASES, PySpy, breakdown_table, categorize, scheduler_pid
from sglang_tokendance.bench.workloads import PRESETS, make_simulation
from sglang_tokendance.bench.server_process import ServerProcess


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="radix,tokendance")
    p.add_argument("--preset", choices=sorted(PRESETS), default="generative_agents")
    p.add_argument("--num-agents", type=int, default=6)
    p.add_argument("--num-rounds", type=int, default=3)
    p.add_argument("--block-words", type=int, default=80)
    p.add_argument("--seed", type=int, default=101, help="held out from the other benchmarks' seeds")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--server-args", default="--chunked-prefill-size 16384 --mem-fraction-static 0.5",
                   help="extra flags for every server")
    p.add_argument("--output", type=Path, default=Path("benchmark/results/profile.md"))
    p.add_argument("--whole-rounds", action="store_true",
                   help="time and sample whole rounds (prefill and decode), not prefill-only ones")
    p.add_argument("--render", action="store_true", help="only rebuild the Markdown from a previous run's files")
    return p.parse_args(argv)


def profile_mode(args, mode_name: str, stacks: Path) -> dict:
    mode = MODES[mode_name]
    config = replace(PRESETS[args.preset], num_agents=args.num_agents, num_rounds=args.num_rounds,
                     block_words=args.block_words, seed=args.seed)
    with ServerProcess([*mode.server_args, *args.server_args.split()], stock=mode.stock) as server:
        spy = PySpy(scheduler_pid(server.proc.pid), stacks, args.rate)
        idle = idle_check()
        result = RunResult(mode.name, config.num_agents, float("inf"))

        def watch(round_index: int):
            return spy.recording() if round_index > 0 else contextlib.nullcontext()

        async def go():
            import aiohttp

            async with aiohttp.ClientSession() as http:
                with tqdm(total=config.num_rounds, desc=f"profile {mode.name}", unit="round") as progress:
                    await run_session(http, server.url, mode, make_simulation(config), 0, result, progress,
                                      prefill_only=not args.whole_rounds, watch=watch)

        asyncio.run(go())
    timed = [r for r in result.rounds if r.round > 0]
    return {"mode": mode.name, "rounds_profiled": len(timed), "prefill_s": sum(r.prefill for r in timed),
            "latency_s": sum(r.latency for r in timed), "cpu_busy_before": idle["cpu_busy_fraction"]}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    summary_path = args.output.with_suffix(".json")
    stacks = {name: args.output.with_name(f"{args.output.stem}_{name}.collapsed.txt") for name in args.modes.split(",")}
    if args.render:
        saved = json.loads(summary_path.read_text())
        command, summary = saved["command"], saved["summary"]
    else:
        command = report.command_line("sglang_tokendance.bench_profile", argv)
        summary = [profile_mode(args, name, path) for name, path in stacks.items()]
        summary_path.write_text(json.dumps({"command": command, "summary": summary}, indent=1))
    what = "whole rounds" if args.whole_rounds else "prefill only"
    sections = [(f"Profiled rounds ({what}, rounds 1 on: those with reuse)",
                 report.markdown_table(summary, ["mode", "rounds_profiled", "prefill_s", "latency_s",
                                                 "cpu_busy_before"]))]
    for name, path in stacks.items():
        collapsed = path.read_text()
        for title, rules in ((f"{name}: by operation", OPERATIONS), (f"{name}: by phase", PHASES)):
            sections.append((title, breakdown_table(categorize(collapsed, rules), rules, args.rate)))
    report.write_markdown(args.output, "Prefill profile (py-spy, scheduler process)", command, sections)
    print(args.output.read_text())


if __name__ == "__main__":
    main()
