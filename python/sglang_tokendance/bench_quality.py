"""`python -m sglang_tokendance.bench_quality`: blended prefill vs full prefill, per selection rule.

Runs our blended prefill (core/blend) in-process on SmolLM2 over All-Gather rounds in chat
format (see sglang_tokendance/bench/quality.py) at N agents each of --num-agents: full prefill
vs plain reuse, every --rules rule at every --ratios recompute ratio and --check-layers check
layer, and an oracle rule (true KV deviation from the full prefill) as the ceiling. Reports
next-token KL(full || blended), top-1 / top-5 agreement, common-prefix length of greedy
continuations, the work done (token-layers vs a full prefill), rounds to first divergence of
a multi-round simulation, and the prefill-time ratio blended / full of one round at the
default setting. Writes JSONL, a Markdown summary (with this command) and a KL-vs-recompute
PNG per N.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from sglang_tokendance.bench import report
from sglang_tokendance.bench.quality import (PLAIN, QualityConfig, QualityRunner, Setting,
                                             measure_divergence, measure_prompts, prefill_timing,
                                             sample_dicts, summarize)
from sglang_tokendance.core.blend import BlendOptions
from sglang_tokendance.core.selection import GRANULARITIES, RULES
from sglang_tokendance.server_args import TokenDanceArgs

DEFAULT_OUTPUT = Path("benchmark/results/quality.jsonl")


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    unknown = [n for n in names if n not in RULES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown rule {unknown[0]!r}; choose from {', '.join(RULES)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = TokenDanceArgs()
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--num-agents", type=_ints, default=(4, 10), help="comma-separated N values")
    p.add_argument("--prompts-per-n", type=int, default=4, help="agent prompts measured per N")
    p.add_argument("--rules", type=_names, default=tuple(RULES), help="selection rules to compare")
    p.add_argument("--ratios", type=_floats, default=(0.15, 0.3, 0.5, 0.8), help="recompute ratios")
    p.add_argument("--check-layers", type=_ints, default=tuple(sorted({1, defaults.check_layer})))
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle (true deviation) rule")
    p.add_argument("--block-head-tokens", type=int, default=defaults.block_head_tokens)
    p.add_argument("--selection-granularity", choices=GRANULARITIES, default=defaults.selection_granularity)
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--no-sparse-writeback", action="store_true")
    p.add_argument("--screen-layer", type=int, default=defaults.screen_layer,
                   help="also run the default rule screened at this layer (0: not)")
    p.add_argument("--screen-factor", type=float, default=defaults.screen_factor)
    p.add_argument("--continuation-tokens", type=int, default=32)
    p.add_argument("--simulation-agents", type=int, default=4)
    p.add_argument("--simulation-rounds", type=int, default=3, help="0 skips the simulation")
    p.add_argument("--history-words", type=int, default=150)
    p.add_argument("--block-words", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--output-file", type=Path, default=DEFAULT_OUTPUT,
                   help="JSONL; the Markdown summary and PNG plots are written beside it")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> QualityConfig:
    options = BlendOptions(block_head_tokens=args.block_head_tokens, granularity=args.selection_granularity,
                           block_size=args.block_size, sparse_writeback=not args.no_sparse_writeback,
                           screen_factor=args.screen_factor)
    return QualityConfig(num_agents=args.num_agents, prompts_per_n=args.prompts_per_n, rules=args.rules, ratios=args.ratios,
                         check_layers=args.check_layers, oracle=not args.no_oracle, options=options,
                         screen_layer=args.screen_layer,
                         continuation_tokens=args.continuation_tokens, simulation_agents=args.simulation_agents,
                         simulation_rounds=args.simulation_rounds, history_words=args.history_words,
                         block_words=args.block_words, seed=args.seed)


def timed_setting(config: QualityConfig) -> Setting:
    """The server's default rule and ratio at the sweep's deepest check layer, with the
    sweep's screen (the server's default setting, in the default sweep)."""
    d = TokenDanceArgs()
    deepest = max(config.check_layers)
    return Setting(d.selection, d.recompute_ratio, deepest, config.screen_layer * (config.screen_layer < deepest))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    config = config_from(args)
    if args.model_path is None:
        from sglang_tokendance.model_store import prepared_default_model

        args.model_path = str(prepared_default_model())
    runner = QualityRunner(args.model_path)
    samples = measure_prompts(runner, config)
    rows = summarize(samples)
    divergence = measure_divergence(runner, config) if config.simulation_rounds > 0 else []
    timing = [prefill_timing(runner, config, timed_setting(config), n) for n in config.num_agents]

    out = args.output_file
    records = [{"kind": "sample", **s} for s in sample_dicts(samples)]
    records += [{"kind": "summary", **r} for r in rows]
    records += [{"kind": "divergence", **{k: v for k, v in asdict(d).items() if k != "outputs"}} for d in divergence]
    records += [{"kind": "timing", **t} for t in timing]
    report.write_jsonl(out, records)
    command = report.command_line("sglang_tokendance.bench_quality", argv)
    columns = ["agents", "setting", "recomputed_share", "work", "kl", "kl_max", "top1", "top5", "common_prefix"]
    sections = [(f"N = {n}: mean over agents", report.markdown_table([r for r in rows if r["agents"] == n], columns))
                for n in config.num_agents]
    if divergence:
        sections.append((f"Rounds to first divergence ({config.simulation_agents} agents, "
                         f"{config.simulation_rounds} rounds; none = never diverged)",
                         report.markdown_table([{"setting": d.setting, "first_divergence": d.first_divergence or "none"}
                                                for d in divergence], ["setting", "first_divergence"])))
    sections.append(("Prefill time of one round at the default setting (one run, same machine)",
                     report.markdown_table(timing, ["setting", "agents", "full_s", "blended_s", "time_ratio",
                                                    "work_ratio"])))
    report.write_markdown(out.with_suffix(".md"), "Blended prefill quality vs full prefill (SmolLM2-135M)",
                          command, sections)
    if not args.no_plot:
        for n in config.num_agents:
            plot_kl(out.with_name(f"{out.stem}_n{n}.png"), [r for r in rows if r["agents"] == n], n)
            plot_kl(out.with_name(f"{out.stem}_n{n}_work.png"), [r for r in rows if r["agents"] == n], n, "work")
    print(out.with_suffix(".md").read_text())


def plot_kl(path: Path, rows: list[dict], agents: int, x: str = "recomputed_share") -> None:
    """KL vs `x` (recomputed share of reused tokens, or work), one line per rule and check layer."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    plain = next((r["kl"] for r in rows if r["rule"] == PLAIN), None)
    for r in sorted(rows, key=lambda r: r[x]):
        if r["rule"] == PLAIN:
            continue
        screen = f" s={r['screen_layer']}" if r.get("screen_layer") else ""
        xs, ys = series.setdefault(f"{r['rule']} c={r['check_layer']}{screen}", ([], []))
        xs.append(r[x])
        ys.append(r["kl"])
    xlabel = {"recomputed_share": "recomputed share of reused tokens",
              "work": "token-layers computed / full prefill's"}[x]
    report.plot_lines(path, f"KL(full || blended), N={agents}", xlabel, "mean next-token KL (log)", series,
                      hline=plain, hline_label="plain reuse (r=0)", logy=True)


if __name__ == "__main__":
    main()
