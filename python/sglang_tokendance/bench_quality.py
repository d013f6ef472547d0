"""`python -m sglang_tokendance.bench_quality`: blended prefill vs full prefill, per selection rule.

Runs our blended prefill (core/blend) in-process on SmolLM2 over All-Gather rounds in chat
format (see sglang_tokendance/bench/quality.py) at N agents each of --num-agents: full prefill
vs plain reuse, every --rules rule at every --ratios recompute ratio and --check-layers check
layer, and an oracle rule (true KV deviation from the full prefill) as the ceiling. Reports
KL(full || blended) at the first output token and at the first --decode-steps decode steps
(teacher-forced on the full prefill's greedy continuation, each side decoding over its own
KV), top-1 / top-5 agreement, common-prefix length of greedy continuations, the work done
(token-layers vs a full prefill), rounds to first divergence of a multi-round simulation,
and the prefill-time ratio blended / full of one round at the default setting. Writes JSONL,
a Markdown summary (with this command) and KL-vs-recompute PNGs per N.

With --groups it measures round groups instead (see measure_groups in
sglang_tokendance/bench/quality_experiments.py): every agent of one round at each N in one batch, under
per-request selection, group-aligned selection and shared probes (--group-probes) at --ratios;
results go to benchmark/results/quality_groups.{jsonl,md,png} by default.

With --master-choice it measures which copy of a shared segment to keep as its Master (see
evaluate_master_choice in sglang_tokendance/bench/quality_experiments.py): the author's, or one of the
copies the members of a round group leave (the medoid, the first reader's), read by the next
round's agents at the server's default setting; results go to
benchmark/results/quality_master_choice.{jsonl,md,png} by default.

With --chunked SIZES it measures chunked prefill instead (see measure_chunked in
sglang_tokendance/bench/quality_experiments.py): each prompt prefilled whole and in chunks of each size, as
SGLang's chunked prefill forwards it, at plain reuse and the default rule at --ratios, each
chunk selecting for itself (as the server does) and `planned` (the whole prompt's selection made
before the first chunk); results go to benchmark/results/quality_chunked.{jsonl,md,png} by default.

With --fidelity it measures how fidelity holds as N grows (see measure_fidelity in
sglang_tokendance/bench/quality_experiments.py): every --fidelity-settings setting on each --presets workload
and --seeds seed at N = 4, 10 and 16 (or --num-agents), with the decode-step KL over content
steps (the full model's entropy above 1 nat) as the headline beside first-token KL and work, top-1
agreement where the full model has no near tie, and the KV deviation by block index; a setting
marked `lead` runs in a round whose leader (its last agent) was prefilled exactly first, as the
server's round leader runs a round. Results go to benchmark/results/quality_fidelity.{jsonl,md,png}
by default, with the content-step KL / work frontier per N (quality_fidelity_frontier_nN.png).

With --server it measures the same prompts through real servers instead: TokenDance servers
at --server-settings vs one with --disable-tokendance, compared on top-logprobs beside the
same truncated measure computed in-process (see sglang_tokendance/bench/quality_server.py);
results go to benchmark/results/quality_server.{jsonl,md,png} by default.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch

from sglang_tokendance.bench import quality_server, report
from sglang_tokendance.bench.quality import (PLAIN, QualityConfig, QualityRunner, Setting)
from sglang_tokendance.bench.quality_experiments import (decode_kl_by_step, default_setting,
                                                         deviation_by_block, measure_chunked, measure_divergence,
                                                         measure_fidelity, measure_groups, measure_master_choice,
                                                         measure_prompts, prefill_timing, reused_kv_gaps, sample_dicts,
                                                         summarize)
from sglang_tokendance.bench.quality_report import (CHUNKED_METRICS, FIDELITY_METRICS, GROUP_METRICS, MASTER_METRICS,
                                                    METRICS, SERVER_MEASURES, chunked_versus, group_versus,
                                                    master_versus, plot_frontier, plot_groups, plot_kl,
                                                    plot_master_choice, plot_server)
from sglang_tokendance.bench.workloads import PRESETS
from sglang_tokendance.bench.quality_server import ServerConfig, Workload
from sglang_tokendance.core.blend_types import BlendOptions
from sglang_tokendance.core.selection import GRANULARITIES, RULES
from sglang_tokendance.server_args import TokenDanceArgs

DEFAULT_OUTPUT = Path("benchmark/results/quality.jsonl")
DEFAULT_SERVER_OUTPUT = Path("benchmark/results/quality_server.jsonl")
DEFAULT_GROUPS_OUTPUT = Path("benchmark/results/quality_groups.jsonl")
DEFAULT_MASTER_OUTPUT = Path("benchmark/results/quality_master_choice.jsonl")
DEFAULT_CHUNKED_OUTPUT = Path("benchmark/results/quality_chunked.jsonl")
DEFAULT_FIDELITY_OUTPUT = Path("benchmark/results/quality_fidelity.jsonl")
DEFAULT_GAPS_OUTPUT = Path("benchmark/results/diff_gaps.jsonl")
GAP_THRESHOLDS = (0.05, 0.1, 0.2, 0.4, 0.8)


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


def _settings(text: str) -> tuple[Setting, ...]:
    try:
        return tuple(Setting.parse(x) for x in text.split(";") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _workloads(text: str) -> tuple[Workload, ...]:
    try:
        return tuple(Workload.parse(x) for x in text.split(";") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _presets(text: str) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown preset {(unknown or [text])[0]!r}; choose from {', '.join(PRESETS)}")
    return names


def server_default_setting() -> Setting:
    d = TokenDanceArgs()
    return Setting(d.selection, d.recompute_ratio, d.check_layer, d.screen_layer)


def fidelity_settings() -> tuple[Setting, ...]:
    """Plain reuse, the server's default, the same under fidelity budgets, the default before
    the re-tuning on decode (our attention-kv rule, checked at layer 5), and the default in a
    round with a leader (the server's default for a round): the candidates for fidelity as N grows."""
    default = server_default_setting()
    return (Setting(PLAIN), default, replace(default, budget=200), replace(default, budget=100),
            Setting("attention-kv", default.ratio, 5, default.screen_layer), replace(default, lead=True))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = TokenDanceArgs()
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--num-agents", type=_ints, default=None,
                   help="comma-separated N values (default: 4,10; with --fidelity 4,10,16)")
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
    p.add_argument("--decode-steps", type=int, default=16,
                   help="teacher-forced decode steps of the decode-step KL (1 to 64)")
    p.add_argument("--refresh-last-token", action="store_true",
                   help="recompute the last prompt token over the written-back KV (write-back experiment)")
    p.add_argument("--simulation-agents", type=int, default=4)
    p.add_argument("--simulation-rounds", type=int, default=3, help="0 skips the simulation")
    p.add_argument("--history-words", type=int, default=150)
    p.add_argument("--block-words", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--output-file", type=Path, default=None,
                   help=f"JSONL; the Markdown summary and PNG plots are written beside it (default: {DEFAULT_OUTPUT}, "
                        f"with --server {DEFAULT_SERVER_OUTPUT})")
    p.add_argument("--no-plot", action="store_true")
    groups = p.add_argument_group("round-group mode")
    groups.add_argument("--groups", action="store_true",
                        help="measure round groups (per-request vs aligned selection vs shared probe) instead of "
                             "the sweep")
    groups.add_argument("--group-probes", type=_ints, default=(1,),
                        help="shared probes to measure: members per shared segment that probe it")
    groups.add_argument("--master-choice", action="store_true",
                        help="measure which copy of a shared segment to keep as its Master (author's vs a "
                             "member's) instead of the sweep")
    chunked = p.add_argument_group("chunked-prefill mode")
    chunked.add_argument("--chunked", type=_ints, default=(),
                         help="measure each prompt prefilled whole and in chunks of these sizes (comma-separated), "
                              "at plain reuse and the default rule at every --ratios, instead of the sweep")
    fidelity = p.add_argument_group("fidelity mode")
    fidelity.add_argument("--fidelity", action="store_true",
                          help="measure fidelity as N grows (content-step decode KL) on several workloads and seeds "
                               "instead of the sweep")
    fidelity.add_argument("--presets", type=_presets, default=("generative_agents", "debate"),
                          help="workload presets (comma-separated)")
    fidelity.add_argument("--seeds", type=_ints, default=(0, 1), help="workload seeds (comma-separated)")
    fidelity.add_argument("--fidelity-settings", type=_settings, default=fidelity_settings(),
                          help="';'-separated settings (default: plain; the server's default; the same with a "
                               "fidelity budget of 200 and 100 approximate tokens (m=); the default before the "
                               "re-tuning on decode (attention-kv c=5); the default in a round led by its last "
                               "agent (lead: the leader prefilled exactly, its blocks the Masters the others read, "
                               "its work shared among them))")
    p.add_argument("--diff-gaps", action="store_true",
                   help="measure what --tokendance-diff-threshold could drop: each reused token's largest relative "
                        "KV gap to its exact KV, over layers (uses --presets, --seeds, --num-agents, "
                        "--prompts-per-n) instead of the sweep")
    server = p.add_argument_group("server mode")
    server.add_argument("--server", action="store_true",
                        help="measure through TokenDance servers vs a --disable-tokendance one instead of the sweep")
    default = server_default_setting()
    server.add_argument("--server-settings", type=_settings,
                        default=(default, replace(default, ratio=0.15), Setting("cacheblend-k", default.ratio, 1),
                                 Setting(PLAIN)),
                        help="';'-separated settings, one server each, e.g. 'plain;attention-kv r=0.3 c=5 s=1' "
                             "(default: the server's default, the same at r=0.15, CacheBlend's rule at c=1, plain)")
    server.add_argument("--server-workloads", type=_workloads,
                        default=(Workload(4, 60), Workload(10, 60), Workload(6, 40)),
                        help="';'-separated workloads 'N=AGENTS w=BLOCK_WORDS [chunk=SIZE]' (default: "
                             "'N=4 w=60;N=10 w=60;N=6 w=40')")
    server.add_argument("--chunked-prefill-size", type=int, default=128,
                        help="also run the workloads with both servers at this --chunked-prefill-size, at the "
                             "first server setting (0: not)")
    server.add_argument("--top-logprobs", type=int, default=20, help="K of the top-K truncated KL")
    server.add_argument("--resume", action="store_true",
                        help="reuse the server answers an interrupted run with the same flags saved beside the "
                             "output file (*.answers.jsonl)")
    server.add_argument("--server-max-total-tokens", type=int, default=8192,
                        help="--max-total-tokens of each started server (the prompts are short; keeps memory low)")
    args = p.parse_args(argv)
    if args.server + args.groups + args.master_choice + bool(args.chunked) + args.fidelity + args.diff_gaps > 1:
        p.error("choose one of --server, --groups, --master-choice, --chunked, --fidelity and --diff-gaps")
    args.num_agents = args.num_agents or ((4, 10, 16) if args.fidelity else (4, 10))
    if any(size < 1 for size in args.chunked):
        p.error(f"--chunked sizes must be positive, got {args.chunked}")
    if not 1 <= args.decode_steps <= 64:
        p.error(f"--decode-steps must be in [1, 64], got {args.decode_steps}")
    if args.server:
        try:
            server_config_from(args)
        except ValueError as e:
            p.error(str(e))
    return args


def blend_options(args: argparse.Namespace) -> BlendOptions:
    return BlendOptions(block_head_tokens=args.block_head_tokens, granularity=args.selection_granularity,
                        block_size=args.block_size, sparse_writeback=not args.no_sparse_writeback,
                        screen_factor=args.screen_factor)


def config_from(args: argparse.Namespace) -> QualityConfig:
    return QualityConfig(num_agents=args.num_agents, prompts_per_n=args.prompts_per_n, rules=args.rules,
                         ratios=args.ratios,
                         check_layers=args.check_layers, oracle=not args.no_oracle, options=blend_options(args),
                         screen_layer=args.screen_layer,
                         continuation_tokens=args.continuation_tokens, decode_steps=args.decode_steps,
                         refresh_last_token=args.refresh_last_token, simulation_agents=args.simulation_agents,
                         simulation_rounds=args.simulation_rounds, history_words=args.history_words,
                         block_words=args.block_words, seed=args.seed)


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(settings=args.server_settings, workloads=args.server_workloads,
                        chunked_prefill=args.chunked_prefill_size, prompts_per_n=args.prompts_per_n,
                        decode_steps=args.decode_steps, top_k=args.top_logprobs, options=blend_options(args),
                        history_words=args.history_words, seed=args.seed, model_path=args.model_path,
                        max_total_tokens=args.server_max_total_tokens)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.model_path is None:
        from sglang_tokendance.model_store import prepared_default_model

        args.model_path = str(prepared_default_model())
    runner = QualityRunner(args.model_path)
    command = report.command_line("sglang_tokendance.bench_quality", argv)
    modes = ("server", "groups", "master_choice", "chunked", "fidelity", "diff_gaps")
    mode = next((m for m in modes if getattr(args, m)), "sweep")
    out = args.output_file or {"server": DEFAULT_SERVER_OUTPUT, "groups": DEFAULT_GROUPS_OUTPUT,
                               "master_choice": DEFAULT_MASTER_OUTPUT, "chunked": DEFAULT_CHUNKED_OUTPUT,
                               "fidelity": DEFAULT_FIDELITY_OUTPUT, "diff_gaps": DEFAULT_GAPS_OUTPUT,
                               "sweep": DEFAULT_OUTPUT}[mode]
    {"server": run_server, "groups": run_groups, "master_choice": run_master_choice, "chunked": run_chunked,
     "fidelity": run_fidelity, "diff_gaps": run_diff_gaps, "sweep": run_sweep}[mode](args, runner, out, command)
    print(out.with_suffix(".md").read_text())


def run_diff_gaps(args: argparse.Namespace, runner: QualityRunner, out: Path, command: str) -> None:
    """--diff-gaps: per preset and N, the share of reused tokens a diff threshold would let read
    their Master (worst-layer gap at most the threshold), quantiles, each layer's median gap."""
    rows = reused_kv_gaps(runner, config_from(args), args.presets, args.seeds)
    summary, layers = [], []
    for preset, n in dict.fromkeys((r["preset"], r["agents"]) for r in rows):
        mine = [r for r in rows if (r["preset"], r["agents"]) == (preset, n)]
        worst = torch.tensor([g for r in mine for g in r["worst"]])
        quantiles = torch.quantile(worst, torch.tensor([0.1, 0.5, 0.9])).tolist()
        summary.append({"preset": preset, "agents": n, "tokens": worst.numel(),
                        **{f"q{q}": v for q, v in zip((10, 50, 90), quantiles)},
                        **{f"share <= {e:g}": float((worst <= e).float().mean()) for e in GAP_THRESHOLDS}})
        median = torch.tensor([r["layer_median"] for r in mine]).mean(0).tolist()
        layers.append({"preset": preset, "agents": n, **{f"L{j}": v for j, v in enumerate(median)}})
    report.write_jsonl(out, [{"kind": "prompt", **r} for r in rows] + [{"kind": "summary", **r} for r in summary])
    report.write_markdown(out.with_suffix(".md"), "What a diff threshold could drop: reused tokens' KV gap to exact "
                          "(SmolLM2-135M)", command, [
                              ("Measure", "Per reused token of each measured prompt: max over layers, K and V, of "
                               "||exact - cached|| / ||exact|| (exact: a full prefill of the prompt; cached: its "
                               "Master, written after its author's context, placed at the reader's positions). "
                               "`share <= e`: the reused tokens a threshold e would let read their Master; the "
                               "recomputed ones (those the selection ranks as deviating most) pass less often."),
                              ("Worst-layer gap per preset and N", report.markdown_table(summary, [
                                  "preset", "agents", "tokens", "q10", "q50", "q90",
                                  *[f"share <= {e:g}" for e in GAP_THRESHOLDS]])),
                              ("Median gap per layer", report.markdown_table(layers, [
                                  "preset", "agents", *[k for k in layers[0] if k.startswith("L")]]))])
    if not args.no_plot:
        series = {f"{r['preset']} N={r['agents']}": (list(GAP_THRESHOLDS), [r[f"share <= {e:g}"] for e in
                                                                          GAP_THRESHOLDS]) for r in summary}
        by_layer = {f"{r['preset']} N={r['agents']}": (list(range(len(r) - 2)), [r[f"L{j}"] for j in range(len(r) - 2)])
                    for r in layers}
        report.plot_panels(out.with_suffix(".png"), "Reused tokens' KV gap to exact", [
            report.Panel("share a threshold lets read the Master", "threshold e", "share of reused tokens", series),
            report.Panel("median gap per layer", "layer", "relative L2 gap", by_layer)])


def run_sweep(args: argparse.Namespace, runner: QualityRunner, out: Path, command: str) -> None:
    """The in-process sweep: JSONL, Markdown, plots."""
    config = config_from(args)
    samples = measure_prompts(runner, config)
    rows = summarize(samples)
    divergence = measure_divergence(runner, config) if config.simulation_rounds > 0 else []
    default = default_setting(config)
    timing = [prefill_timing(runner, config, default, n) for n in config.num_agents]

    records = [{"kind": "sample", **s} for s in sample_dicts(samples)]
    records += [{"kind": "summary", **r} for r in rows]
    records += [{"kind": "divergence", **{k: v for k, v in asdict(d).items() if k != "outputs"}} for d in divergence]
    records += [{"kind": "timing", **t} for t in timing]
    report.write_jsonl(out, records)
    columns = ["agents", "setting", "recomputed_share", "work", "first_kl", "decode_kl", "content_kl", "first_kl_max",
               "decode_kl_max", "top1", "top5", "common_prefix"]
    sections = [("Metrics", METRICS.format(steps=config.decode_steps))]
    sections += [(f"N = {n}: mean over agents", report.markdown_table([r for r in rows if r["agents"] == n], columns))
                 for n in config.num_agents]
    windows = [(a, min(a + 3, config.decode_steps)) for a in range(1, config.decode_steps + 1, 4)]
    by_step = decode_kl_by_step(samples, default.label, windows)
    sections.append((f"Decode-step KL by step at {default.label} (mean over agents)",
                     report.markdown_table(by_step, ["agents", *[f"steps {a}-{b}" for a, b in windows]])))
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
            plot_kl(out.with_name(f"{out.stem}_n{n}.png"), [r for r in rows if r["agents"] == n], n,
                    config.decode_steps)
            plot_kl(out.with_name(f"{out.stem}_n{n}_work.png"), [r for r in rows if r["agents"] == n], n,
                    config.decode_steps, "work")


def write_compared(out: Path, kind: str, samples: list, versus_of: Callable[[list[dict]], list[dict]]
                   ) -> tuple[list[dict], list[dict]]:
    """A comparison mode's JSONL (`kind`_sample, _summary, _versus records): its summary rows
    (bench/quality summarize) and each row set beside its baseline (`versus_of(rows)`)."""
    rows = summarize(samples)
    versus = versus_of(rows)
    report.write_jsonl(out, [{"kind": f"{kind}_sample", **s} for s in sample_dicts(samples)]
                       + [{"kind": f"{kind}_summary", **r} for r in rows]
                       + [{"kind": f"{kind}_versus", **v} for v in versus])
    return rows, versus


def run_groups(args: argparse.Namespace, runner: QualityRunner, out: Path, command: str) -> None:
    """Round-group mode: JSONL, Markdown, plot."""
    config = config_from(args)
    rows, versus = write_compared(out, "group", measure_groups(runner, config, args.group_probes), group_versus)
    columns = ["agents", "setting", "recomputed_share", "adopted_share", "work", "first_kl", "decode_kl",
               "decode_kl_max", "top1", "top5", "common_prefix"]
    sections = [("Metrics", METRICS.format(steps=config.decode_steps) + GROUP_METRICS),
                ("Group modes vs per-request selection at the same ratio (decode-step KL)",
                 report.markdown_table(versus, ["agents", "ratio", "mode", "decode_kl", "per_request_decode_kl",
                                                "kl_vs_per_request", "within_10pct", "work",
                                                "per_request_work"]))]
    sections += [(f"N = {n}: one round, every agent in one batch (mean over agents)",
                  report.markdown_table([r for r in rows if r["agents"] == n], columns)) for n in config.num_agents]
    report.write_markdown(out.with_suffix(".md"), "Collective blended prefill: round groups vs per-request selection "
                          "(SmolLM2-135M)", command, sections)
    if not args.no_plot:
        plot_groups(out.with_suffix(".png"), rows, config)


def run_chunked(args: argparse.Namespace, runner: QualityRunner, out: Path, command: str) -> None:
    """Chunked-prefill mode: JSONL, Markdown, plot."""
    config = config_from(args)
    _, versus = write_compared(out, "chunked", measure_chunked(runner, config, args.chunked), chunked_versus)
    columns = ["agents", "setting", "chunk", "recomputed_share", "work", "first_kl", "decode_kl", "content_kl",
               "decode_kl_max", "kl_vs_whole", "within_1.2x", "top1", "common_prefix"]
    sections = [("Metrics", METRICS.format(steps=config.decode_steps) + CHUNKED_METRICS)]
    sections += [(f"N = {n} (mean over agents)", report.markdown_table([r for r in versus if r["agents"] == n],
                                                                        columns)) for n in config.num_agents]
    report.write_markdown(out.with_suffix(".md"), "Blended prefill in chunks vs whole (SmolLM2-135M)", command,
                          sections)
    if not args.no_plot:
        panels = [report.Panel(f"N={n}", "chunked-prefill size (0: whole prompt)", "mean decode-step KL (log)", {
            r["setting"]: ([v["chunk"] for v in versus if (v["agents"], v["setting"]) == (n, r["setting"])],
                           [v["decode_kl"] for v in versus if (v["agents"], v["setting"]) == (n, r["setting"])])
            for r in versus if r["agents"] == n}, logy=True) for n in config.num_agents]
        report.plot_panels(out.with_suffix(".png"), f"Decode-step KL (first {config.decode_steps} steps) by chunk size",
                           panels)


def run_fidelity(args: argparse.Namespace, runner: QualityRunner, out: Path, command: str) -> None:
    """Fidelity mode: JSONL, Markdown (means over seeds per workload and N; every seed; KV
    deviation by block), plot (content-step KL and work vs N per workload)."""
    config = config_from(args)
    samples = measure_fidelity(runner, config, args.presets, args.seeds, args.fidelity_settings)
    rows = summarize(samples)
    pooled = summarize(replace(s, seed=-1) for s in samples)  # every seed's agents together
    deviation = [row for setting in dict.fromkeys(s.label for s in args.fidelity_settings)
                 for row in deviation_by_block(samples, setting)]
    report.write_jsonl(out, [{"kind": "fidelity_sample", **s} for s in sample_dicts(samples)]
                       + [{"kind": "fidelity_summary", **r} for r in rows]
                       + [{"kind": "fidelity_pooled", **r} for r in pooled]
                       + [{"kind": "fidelity_deviation", **d} for d in deviation])
    columns = ["agents", "setting", "approximate_tokens", "work", "content_kl", "decode_kl", "first_kl",
               "decisive_top1", "common_prefix", "content_steps"]
    sections = [("Metrics", METRICS.format(steps=config.decode_steps) + FIDELITY_METRICS)]
    sections += [(f"{preset}, seeds {', '.join(map(str, args.seeds))} pooled ({config.prompts_per_n} agents per N "
                  f"and seed)", report.markdown_table([r for r in pooled if r["preset"] == preset], columns))
                 for preset in args.presets]
    sections += [(f"{preset}, seed {seed}", report.markdown_table(
        [r for r in rows if (r["preset"], r["seed"]) == (preset, seed)], columns))
        for preset in args.presets for seed in args.seeds]
    width = max((len(d) - 3 for d in deviation), default=0)
    sections.append(("KV deviation from the full prefill by block index (relative L2 over all layers; mean over "
                     "seeds and agents)", report.markdown_table(deviation, ["preset", "agents", "setting",
                                                                            *[f"block {j}" for j in range(width)]])))
    report.write_markdown(out.with_suffix(".md"), "Fidelity as N grows: blended vs full prefill (SmolLM2-135M)",
                          command, sections)
    if not args.no_plot:
        panels = [report.Panel(f"{preset}: {metric}", "agents (N)", label, {
            setting: ([r["agents"] for r in pooled if (r["preset"], r["setting"]) == (preset, setting)],
                      [r[metric] for r in pooled if (r["preset"], r["setting"]) == (preset, setting)])
            for setting in dict.fromkeys(s.label for s in args.fidelity_settings)}, logy=metric == "content_kl")
            for preset in args.presets
            for metric, label in (("content_kl", "content-step decode KL (log)"), ("work", "work / full prefill"))]
        report.plot_panels(out.with_suffix(".png"), "Fidelity and work as N grows", panels)
        for n in config.num_agents:
            plot_frontier(out.with_name(f"{out.stem}_frontier_n{n}.png"),
                          [r for r in pooled if r["agents"] == n], args.presets, n)


def run_master_choice(args: argparse.Namespace, runner: QualityRunner, out: Path, command: str) -> None:
    """Master-choice mode: JSONL, Markdown, plot."""
    config = config_from(args)
    rows, versus = write_compared(out, "master", measure_master_choice(runner, config), master_versus)
    columns = ["agents", "setting", "master", "recomputed_share", "work", "first_kl", "decode_kl", "decode_kl_max",
               "top1", "top5", "common_prefix"]
    sections = [("Metrics", METRICS.format(steps=config.decode_steps) + MASTER_METRICS.format(
                    setting=default_setting(config).label)),
                ("Member copies vs the author's at the same N and setting (decode-step KL)",
                 report.markdown_table(versus, ["agents", "setting", "master", "decode_kl", "author_decode_kl",
                                                "kl_vs_author", "first_kl", "author_first_kl", "wins_10pct"]))]
    sections += [(f"N = {n}: round 1, every agent in one batch (mean over agents)",
                  report.markdown_table([r for r in rows if r["agents"] == n], columns)) for n in config.num_agents]
    report.write_markdown(out.with_suffix(".md"), "Which copy of a segment to keep as its Master (SmolLM2-135M)",
                          command, sections)
    if not args.no_plot:
        plot_master_choice(out.with_suffix(".png"), rows, config)


def run_server(args: argparse.Namespace, runner: QualityRunner, out: Path, command: str) -> None:
    """Server mode: JSONL, Markdown, plot."""
    config = server_config_from(args)
    saved = quality_server.SavedAnswers(out.with_suffix(".answers.jsonl"), config, args.resume)
    write_server_report(out, command, config, quality_server.run(config, runner, saved), plot=not args.no_plot)


def write_server_report(out: Path, command: str, config: ServerConfig, samples: list[quality_server.ServerSample],
                        plot: bool) -> None:
    """Server mode's JSONL, Markdown and plot of `samples`."""
    rows = quality_server.summarize(samples)
    report.write_jsonl(out, [{"kind": "server_sample", **asdict(s)} for s in samples]
                       + [{"kind": "server_summary", **r} for r in rows])
    sections = [("Measures", SERVER_MEASURES.format(k=config.top_k, steps=config.decode_steps,
                                                    n=config.decode_steps + 1)),
                ("Truncated KL, server vs in-process (mean over agents)", report.markdown_table(rows, [
                    "workload", "setting", "server_first_tkl", "inproc_first_tkl", "server_decode_tkl",
                    "inproc_decode_tkl", "steps_compared", "server_agree", "inproc_agree", "noise_first_tkl",
                    "noise_decode_tkl", "noise_agree"])),
                ("Content steps (mean over agents)", report.markdown_table(rows, [
                    "workload", "setting", "server_content_tkl", "inproc_content_kl", "inproc_decode_kl",
                    "content_steps"])),
                ("Reuse counts and full-vocabulary KL (mean over agents)", report.markdown_table(rows, [
                    "workload", "setting", "same_prompts", "server_hits", "inproc_hits", "server_reused",
                    "inproc_reused", "server_recomputed", "inproc_recomputed", "server_own",
                    "server_within_threshold", "server_compression", "inproc_first_kl", "inproc_decode_kl"])),
                ("Members that read Masters (mean over them; a led round's leader, computed exactly, left out)",
                 report.markdown_table(rows, [
                     "workload", "setting", "readers", "readers_server_first_tkl", "readers_inproc_first_tkl",
                     "readers_server_decode_tkl", "readers_inproc_decode_tkl", "readers_server_content_tkl",
                     "readers_inproc_content_kl", "readers_server_agree"]))]
    report.write_markdown(out.with_suffix(".md"), "Blended prefill quality through the server vs in-process "
                          "(SmolLM2-135M)", command, sections)
    if plot:
        plot_server(out.with_suffix(".png"), samples)


if __name__ == "__main__":
    main()
