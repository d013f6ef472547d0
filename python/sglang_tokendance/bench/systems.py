"""The systems bench_multiagent compares: each started in turn (bench/server_process), or the
one running server it was pointed at, and one timed load over a system (with tqdm progress).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from tqdm import tqdm

from sglang_tokendance.bench.multiagent import MODES, Mode, RunResult, run_load
from sglang_tokendance.bench.workloads import WorkloadConfig

def server_argv(args, mode: Mode) -> list[str]:
    argv = list(mode.server_args)
    if args.model_path:
        argv += ["--model-path", args.model_path]
    if args.max_total_tokens:
        argv += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.capacity:
        argv.append("--enable-metrics")  # SGLang's retraction counter
    return argv + args.server_args.split()


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

    def serve(self, mode: Mode, env: dict[str, str] | None = None):
        if self.running:
            return _Running(self.running[1])
        from sglang_tokendance.bench.server_process import ServerProcess

        return ServerProcess(server_argv(self.args, mode), stock=mode.stock, env=env)


class _Running:
    def __init__(self, url: str):
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def run(mode: Mode, url: str, config: WorkloadConfig, sessions: int, rate: float, label: str,
        prefill_only: bool = False, watch=None) -> RunResult:
    with tqdm(total=sessions * config.num_rounds, desc=label, unit="round") as progress:
        return asyncio.run(run_load(url, mode, config, sessions, rate, progress, prefill_only, watch))


def warm_up(mode: Mode, url: str, config: WorkloadConfig, prefill_only: bool = False) -> None:
    """One small round first, so no mode pays one-off start-up costs inside the timing."""
    run(mode, url, replace(config, num_agents=1, num_rounds=1, seed=config.seed + 10_000), 1, float("inf"),
        f"{mode.name} warm-up", prefill_only)


def mode_orders(modes: list[Mode], repeats: int) -> list[list[Mode]]:
    """The modes' order in each repeat of the capacity search: reversed every other time, so
    no mode always runs first on a machine whose speed drifts."""
    return [modes if r % 2 == 0 else modes[::-1] for r in range(repeats)]
