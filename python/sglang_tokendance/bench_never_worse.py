"""`python -m sglang_tokendance.bench_never_worse`: TokenDance against stock radix on every workload shape.

Turning TokenDance on must never lose what stock SGLang gives. Each shape runs one simulation
(bench_multiagent's whole rounds: prefill and decode) on a stock radix server and on a TokenDance
server, both emptied first (`/flush_cache`), `--repeats` times with the order alternating (round
times on two cores move by 10-30% from run to run), and sets them side by side over the rounds
after the first: round prefill and round latency (radix's time over TokenDance's: >= 1 is never
worse), and the prompt tokens served exactly from the radix tree (TokenDance's over radix's:
>= 1 is never less exact) next to the tokens TokenDance reused approximately and those it read
from a kept row (mirror storage: the agent's own earlier request's KV, approximate where that
request read Masters; never computed twice). The next round's
blocks are this round's answers, so where TokenDance answers differently the two sides' later
prompts differ a little (their prompt tokens are given). One pair of
servers serves every shape but the chunked one, which has its own pair.

Shapes:
  all-gather     every agent's prompt: its private history, then every agent's message in its own order
  static         a static briefing after each agent's private notes, recurring every round (debate preset)
  conversation   each prompt extends the agent's previous prompt and answer (a growing transcript)
  unmarked       all-gather prompts sent without separators: found by their content-defined chunks
  chunked        all-gather with both servers at --chunked-prefill-size 128
  static-cached  static, with round 0's blocks cached before it (by another simulation or earlier
                 requests): round 0 reads them approximately, so round 1 is the round after an
                 approximate read
  conversation-cached  conversation, likewise

Besides the means over the rounds after the first, each round's ratio (round 0's included) and
the cumulative one over every round.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sglang_tokendance.bench import report
from sglang_tokendance.bench.machine import idle_check
from sglang_tokendance.bench.multiagent import MODES
from sglang_tokendance.bench.server_process import ServerProcess, flush_cache
from sglang_tokendance.bench.workloads import PRESETS, WorkloadConfig
from sglang_tokendance.bench.systems import run, warm_up


@dataclass(frozen=True)
class Shape:
    name: str
    preset: str
    conversation: bool = False
    tokendance_mode: str = "tokendance"  # how prompts reach the TokenDance server (bench/multiagent MODES)
    chunked_prefill: int = 0  # both servers' --chunked-prefill-size (0: SGLang's default)
    blocks_cached: bool = False  # round 0's blocks cached before it (another simulation, earlier requests)

    def config(self, args: argparse.Namespace) -> WorkloadConfig:
        return replace(PRESETS[self.preset], num_agents=args.num_agents, num_rounds=args.num_rounds,
                       max_new_tokens=args.max_new_tokens, seed=args.seed, conversation=self.conversation,
                       blocks_cached=self.blocks_cached)


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("all-gather", "generative_agents"),
    Shape("static", "debate"),
    Shape("conversation", "generative_agents", conversation=True),
    Shape("unmarked", "generative_agents", tokendance_mode="tokendance-unmarked"),
    Shape("chunked", "generative_agents", chunked_prefill=128),
    Shape("static-cached", "debate", blocks_cached=True),
    Shape("conversation-cached", "generative_agents", conversation=True, blocks_cached=True),
)}


def later(by_round: dict[str, float]) -> list[float]:
    """The values of the rounds after the first (the ones reuse or the tree can serve)."""
    return [v for k, v in by_round.items() if int(k) > 0]


def shape_row(shape: Shape, summaries: dict[str, list[dict]]) -> dict:
    """TokenDance against radix on one shape, over the rounds after the first: each mode's
    repeats (`summaries[mode]`, one summary per run) pooled. Times are the mean round over every
    repeat (the speedups' ratio of means, and each repeat's own ratio at its worst); tokens are
    totals over the repeats."""
    radix, ours = summaries["radix"], summaries[shape.tokendance_mode]

    def mean_later(runs: list[dict], key: str) -> float:
        values = [v for summary in runs for v in later(summary[key])]
        return sum(values) / len(values)

    def total_later(runs: list[dict], key: str) -> int:
        return sum(sum(later(summary[key])) for summary in runs)

    def speedup(key: str) -> float:
        return mean_later(radix, key) / mean_later(ours, key)

    def worst_speedup(key: str) -> float:
        return min(mean_later([r], key) / mean_later([o], key) for r, o in zip(radix, ours))

    def by_round(key: str) -> dict[str, float]:
        rounds = sorted(radix[0][key], key=int)
        return {k: round(sum(r[key][k] for r in radix) / sum(o[key][k] for o in ours), 3) for k in rounds}

    def cumulative(key: str) -> float:
        return sum(sum(r[key].values()) for r in radix) / sum(sum(o[key].values()) for o in ours)

    exact_radix, exact_ours = total_later(radix, "cached_tokens_by_round"), total_later(ours, "cached_tokens_by_round")
    last = max(radix[0]["cached_tokens_by_round"], key=int)
    return {
        "shape": shape.name, "mode": shape.tokendance_mode, "repeats": len(ours),
        "prefill_speedup": speedup("round_prefill_by_round_s"),
        "prefill_speedup_worst": worst_speedup("round_prefill_by_round_s"),
        "latency_speedup": speedup("round_latency_by_round_s"),
        "latency_speedup_worst": worst_speedup("round_latency_by_round_s"),
        "prefill_speedup_by_round": by_round("round_prefill_by_round_s"),
        "latency_speedup_by_round": by_round("round_latency_by_round_s"),
        "latency_speedup_cumulative": cumulative("round_latency_by_round_s"),
        "prompt_tokens_radix": total_later(radix, "prompt_tokens_by_round"),
        "prompt_tokens": total_later(ours, "prompt_tokens_by_round"),
        "exact_tokens_radix": exact_radix, "exact_tokens": exact_ours,
        "exact_ratio": exact_ours / exact_radix if exact_radix else None,
        "last_round_exact_tokens_radix": sum(s["cached_tokens_by_round"][last] for s in radix),
        "last_round_exact_tokens": sum(s["cached_tokens_by_round"][last] for s in ours),
        "last_round_kept_tokens": sum(s["kept_tokens_by_round"][last] for s in ours),
        "approximate_tokens": total_later(ours, "reused_tokens_by_round"),
        "kept_tokens": total_later(ours, "kept_tokens_by_round"),
        "errors": sum(s["errors"] for s in (*radix, *ours)),
    }


def run_shapes(shapes: list[Shape], args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Every shape on its pair of servers, `args.repeats` times with the modes' order alternating
    (radix first, then TokenDance first, ...): its comparison row, and every request's, round's
    and idle check's record."""
    rows, records = [], []
    for chunk in dict.fromkeys(shape.chunked_prefill for shape in shapes):
        extra = [*(["--model-path", args.model_path] if args.model_path else []),
                 *(["--chunked-prefill-size", str(chunk)] if chunk else [])]
        with contextlib.ExitStack() as stack:
            urls = ({True: args.radix_url, False: args.tokendance_url} if args.radix_url else
                    {stock: stack.enter_context(ServerProcess(extra, stock=stock)).url for stock in (True, False)})
            for shape in (s for s in shapes if s.chunked_prefill == chunk):
                config = shape.config(args)
                modes = [MODES["radix"], MODES[shape.tokendance_mode]]
                summaries: dict[str, list[dict]] = {mode.name: [] for mode in modes}
                records.append({"type": "idle", "shape": shape.name, **idle_check()})
                for repeat in range(args.repeats):
                    for mode in modes if repeat % 2 == 0 else modes[::-1]:
                        url = urls[mode.stock]
                        warm_up(mode, url, config)
                        flush_cache(url)
                        result = run(mode, url, config, 1, float("inf"), f"{shape.name}: {mode.name} #{repeat}")
                        summaries[mode.name].append(result.summary())
                        records += [{"type": kind, "shape": shape.name, "mode": mode.name, "repeat": repeat,
                                     **asdict(r)}
                                    for kind, items in (("request", result.requests), ("round", result.rounds))
                                    for r in items]
                rows.append(shape_row(shape, summaries))
    return rows, records


def plot(path: Path, rows: list[dict]) -> None:
    """Per shape: prefill and latency speedups and the exact-token ratio against radix (1 = radix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("prefill_speedup", "round prefill: radix / TokenDance"),
            ("latency_speedup", "round latency: radix / TokenDance"),
            ("exact_ratio", "exact tokens: TokenDance / radix")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(keys)
    for i, (key, label) in enumerate(keys):
        ax.bar([x + i * width for x in range(len(rows))], [r[key] or 0 for r in rows], width, label=label)
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set_xticks([x + width for x in range(len(rows))], [r["shape"] for r in rows])
    ax.set_ylabel("ratio against stock radix (>= 1: never worse)")
    ax.set_title("Rounds after the first, TokenDance against stock radix")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_never_worse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"from {', '.join(SHAPES)}")
    p.add_argument("--num-agents", type=int, default=6)
    p.add_argument("--num-rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--model-path", default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--output-file", type=Path, default=Path("benchmark/results/never_worse.jsonl"),
                   help="JSONL; the Markdown summary and the PNG plot are written beside it")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each mode per shape, the modes' order alternating (radix first in even repeats)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--radix-url", default=None, help="drive this running stock SGLang server instead of starting "
                   "one (with --tokendance-url: a TokenDance server with its defaults; shapes without chunked prefill)")
    p.add_argument("--tokendance-url", default=None)
    args = p.parse_args(argv)
    if (args.radix_url is None) != (args.tokendance_url is None):
        p.error("--radix-url and --tokendance-url go together")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.num_rounds < 2:
        p.error("--num-rounds must be at least 2: the rounds after the first are compared")
    chunked = [s for s in args.shapes.split(",") if SHAPES[s].chunked_prefill]
    if args.radix_url and (chunked or args.model_path):
        p.error(f"running servers serve their own model without chunked prefill: drop --model-path and "
                f"{', '.join(chunked) or 'nothing else'}")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rows, records = run_shapes([SHAPES[name] for name in args.shapes.split(",")], args)
    command = report.command_line("sglang_tokendance.bench_never_worse", argv)
    report.write_jsonl(args.output_file, [{"type": "meta", "command": command},
                                          *({"type": "shape", **r} for r in rows), *records])
    if not args.no_plot:
        plot(args.output_file.with_suffix(".png"), rows)
    idles = [r for r in records if r["type"] == "idle"]
    per_round = [{"shape": r["shape"], **{f"prefill r{k}": v for k, v in r["prefill_speedup_by_round"].items()},
                  **{f"latency r{k}": v for k, v in r["latency_speedup_by_round"].items()},
                  "latency, all rounds": r["latency_speedup_cumulative"]} for r in rows]
    md = args.output_file.with_suffix(".md")
    report.write_markdown(md, "Never worse than radix: every shape, rounds after the first", command, [
        ("Machine idle before each shape", report.markdown_table(idles, ["shape", "cpu_busy_fraction", "idle"])),
        (f"TokenDance against stock radix ({args.repeats} runs of each mode per shape, order alternating)",
         report.markdown_table(rows, [k for k in rows[0] if not k.endswith("_by_round")])),
        ("Each round and all of them, radix's time over TokenDance's (>= 1: never worse)",
         report.markdown_table(per_round, list(per_round[0])))])
    print(md.read_text())


if __name__ == "__main__":
    main()
