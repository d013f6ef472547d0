"""`python -m sglang_tokendance.bench_round_hold`: what holding an inferred round costs an
unmodified client, per `--tokendance-round-window-ms`.

One round of a plain-text simulation (bench_group_chat's `text` client: no markers, no names,
nothing cached), its N requests sent `--gaps-ms` apart, each asking for one token (its latency
is its time to first token). Per setting and gap, over `--repeats` rounds (each its own
simulation, the cache flushed between): the members' mean time to first token, the round's
makespan (first send to last first token) and the tokens read from Masters. Settings: stock
SGLang's path (`--disable-tokendance`), content-defined chunks with no inferred rounds (nothing
held), and the defaults at each window.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from tqdm import tqdm

from sglang_tokendance.bench import report
from sglang_tokendance.bench.server_process import ServerProcess, flush_cache
from sglang_tokendance.bench.workloads import WorkloadConfig, make_simulation
from sglang_tokendance.bench_group_chat import TIMEOUT, text_body


def settings(windows: list[int]) -> dict[str, tuple[str, ...]]:
    return {"stock": ("--disable-tokendance",), "no-hold": ("--tokendance-round-min-shared", "0"),
            **{f"window-{w}": ("--tokendance-round-window-ms", str(w)) for w in windows}}


def round_prompts(n: int, seed: int) -> list[dict]:
    sim = make_simulation(WorkloadConfig(num_agents=n, num_rounds=1, history_words=100, block_words=60, seed=seed))
    conversation = [f"{sim.agents[j].name}: {m}" for j, m in enumerate(sim.seed_messages)]
    return [text_body(sim, a, conversation, 0) for a in range(n)]


def send_staggered(url: str, bodies: list[dict], gap_s: float) -> tuple[list[float], float, int]:
    """Each body sent `gap_s` after the last; (each request's time to its one token from its
    own send, the makespan from the first send, tokens reused)."""
    def ask(i: int) -> tuple[float, float, int]:
        time.sleep(i * gap_s)
        sent = time.perf_counter()
        r = requests.post(url + "/v1/completions", timeout=TIMEOUT, json={
            "model": "default", **bodies[i], "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        reuse = (r.json().get("metadata") or {}).get("tokendance", {})
        done = time.perf_counter()
        return done - sent, done, reuse.get("reused_tokens", 0)

    start = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        outs = list(pool.map(ask, range(len(bodies))))
    return [o[0] for o in outs], max(o[1] for o in outs) - start, sum(o[2] for o in outs)


def run(args: argparse.Namespace) -> list[dict]:
    model = ["--model-path", args.model_path] if args.model_path else []
    chosen = settings(args.windows)
    rows = []
    with tqdm(total=len(chosen) * len(args.gaps_ms) * args.repeats, desc="held rounds", unit="round") as progress:
        for name, flags in chosen.items():
            with ServerProcess([*model, *flags]) as server:
                for gap in args.gaps_ms:
                    for rep in range(args.repeats):
                        flush_cache(server.url)
                        ttfts, makespan, reused = send_staggered(server.url, round_prompts(args.num_agents,
                                                                                           args.seed + rep), gap / 1000)
                        rows.append({"type": "round", "setting": name, "gap_ms": gap, "repeat": rep,
                                     "mean_ttft_s": statistics.fmean(ttfts), "max_ttft_s": max(ttfts),
                                     "makespan_s": makespan, "reused_tokens": reused})
                        progress.update(1)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Medians over repeats, and each against stock's at the same gap."""
    keys = dict.fromkeys((r["setting"], r["gap_ms"]) for r in rows)
    out = []
    for setting, gap in keys:
        mine = [r for r in rows if (r["setting"], r["gap_ms"]) == (setting, gap)]
        stock = [r for r in rows if (r["setting"], r["gap_ms"]) == ("stock", gap)]
        row = {"type": "summary", "setting": setting, "gap_ms": gap, "repeats": len(mine)}
        for key in ("mean_ttft_s", "makespan_s", "reused_tokens"):
            row[key] = statistics.median(r[key] for r in mine)
            if stock and key != "reused_tokens":
                row[f"{key}_vs_stock"] = row[key] / statistics.median(r[key] for r in stock)
        row["makespan_spread_s"] = f"{min(r['makespan_s'] for r in mine):.2f}-{max(r['makespan_s'] for r in mine):.2f}"
        out.append(row)
    return out


def plot(path: Path, summary: list[dict]) -> None:
    def series(key: str) -> dict:
        return {f"gap {gap} ms": ([s["setting"] for s in summary if s["gap_ms"] == gap],
                                  [s[key] for s in summary if s["gap_ms"] == gap])
                for gap in dict.fromkeys(s["gap_ms"] for s in summary)}

    report.plot_panels(path, "What holding an inferred round costs (round 0, unmodified text client)", [
        report.Panel("members' mean time to first token", "setting", "seconds", series("mean_ttft_s")),
        report.Panel("round makespan", "setting", "seconds", series("makespan_s")),
        report.Panel("tokens read from Masters", "setting", "tokens", series("reused_tokens")),
    ])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_round_hold", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-agents", type=int, default=8)
    p.add_argument("--windows", default="10,50,200", help="comma-separated --tokendance-round-window-ms values")
    p.add_argument("--gaps-ms", default="0,25", help="comma-separated gaps between a round's sends")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--model-path", default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--output-file", type=Path, default=Path("benchmark/results/round_hold.jsonl"),
                   help="JSONL; the Markdown summary and the PNG plot are written beside it")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        args.windows = [int(w) for w in args.windows.split(",")]
        args.gaps_ms = [int(g) for g in args.gaps_ms.split(",")]
    except ValueError:
        p.error("--windows and --gaps-ms must be comma-separated integers")
    if args.num_agents < 2 or args.repeats < 1 or min(args.windows) < 1 or min(args.gaps_ms) < 0:
        p.error("--num-agents >= 2, --repeats >= 1, windows >= 1 ms and gaps >= 0 ms")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rows = run(args)
    summary = summarise(rows)
    command = report.command_line("sglang_tokendance.bench_round_hold", argv)
    report.write_jsonl(args.output_file, [{"type": "meta", "command": command}, *rows, *summary])
    columns = ["setting", "gap_ms", "repeats", "mean_ttft_s", "mean_ttft_s_vs_stock", "makespan_s",
               "makespan_s_vs_stock", "makespan_spread_s", "reused_tokens"]
    report.write_markdown(args.output_file.with_suffix(".md"), "What holding an inferred round costs", command,
                          [("Medians over repeats (one round of N plain-text requests, nothing cached)",
                            report.markdown_table(summary, columns))])
    if not args.no_plot:
        plot(args.output_file.with_suffix(".png"), summary)


if __name__ == "__main__":
    main()
