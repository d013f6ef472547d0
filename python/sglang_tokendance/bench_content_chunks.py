"""`python -m sglang_tokendance.bench_content_chunks`: how much shared text content-defined chunks
find in prompts without markers, and what they cost on prompts that share nothing.

Recall (no server; the model's tokenizer): each workload round's prompts are sent as plain text
(the simulation's blocks concatenated, no separators). The truly shared tokens of a prompt are
those of its shared blocks (context documents and the agents' messages); one is found when the
chunk holding it is also a chunk of another prompt of the round, or when the forest's plan
(core/plan) reads it next to such a chunk: a missed chunk beside a found one reads the tokens it
shares with the chunk its author held beside the found one (the shared text's head and tail,
cut into a chunk with whatever preceded or follows it). `chunk_recall`: whole chunks alone.
Per workload and chunk spacing: recall, chunks per prompt and their mean length, and the tokens
of a round's prompts that match a chunk of another simulation's round (text the two share
without meaning to: templates, names). The default spacing was chosen on generative_agents; the
others validate it.

Overhead (`--overhead-repeats`, through two servers): prompts that share nothing, each sent
once to a server with the defaults and once to `--disable-tokendance`, one request at a time,
alternating which goes first; per repeat the ratio of their total latencies, disabled over
default (>= 1: the default is no slower).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import requests
from tqdm import tqdm

from sglang_tokendance.bench import report
from sglang_tokendance.bench.server_process import ServerProcess, flush_cache
from sglang_tokendance.bench.workloads import PRESETS, Simulation, make_simulation, preset_config
from sglang_tokendance.core.content_chunks import ChunkRule
from sglang_tokendance.core.plan import plan_chunk
from sglang_tokendance.core.segments import SegmentSpan
from sglang_tokendance.server_args import DEFAULT_CHUNK_SPACING

TUNED_ON = "generative_agents"


def round_prompts(sim: Simulation, tokenizer) -> list[tuple[list[int], list[bool]]]:
    """Round 0's plain prompts as SGLang tokenises them, each with which tokens are shared."""
    prompts = []
    for agent in range(len(sim.agents)):
        pieces = sim.prompt_pieces(agent, 0, sim.seed_messages)
        shared_pieces = set(sim.context[0]) | set(sim.seed_messages)
        text, ranges = "", []
        for piece in pieces:
            if piece in shared_pieces and pieces.index(piece) > 0:
                ranges.append((len(text), len(text) + len(piece)))
            text += piece
        encoded = tokenizer(text, return_offsets_mapping=True)
        shared = [any(a <= start and end <= b for a, b in ranges) and end > start
                  for start, end in encoded["offset_mapping"]]
        prompts.append((encoded["input_ids"], shared))
    return prompts


def chunk_keys(rule: ChunkRule, ids: list[int]) -> list[tuple[tuple[int, int], tuple[int, ...]]]:
    return [((s, e), tuple(ids[s:e])) for s, e in rule.chunks(ids) if e - s >= rule.min_tokens]


def recall_row(rule: ChunkRule, prompts, strangers) -> dict:
    """Shared tokens found, over one round's prompts; `strangers`: another simulation's round.
    A prompt's chunks are looked up among the other prompts' (each chunk's Master: the first
    other prompt holding it) and planned as the forest plans them (core/plan.plan_chunk): a
    missed chunk next to a found one reads what it shares with the Master its author held beside
    the found one (`recall`); `chunk_recall` counts whole chunks found alone."""
    keyed = [chunk_keys(rule, ids) for ids, _ in prompts]
    foreign = {key for ids, _ in strangers for _, key in chunk_keys(rule, ids)}
    holders: dict[tuple, list[tuple[int, int]]] = {}
    for j, chunks in enumerate(keyed):
        for k, (_, key) in enumerate(chunks):
            holders.setdefault(key, []).append((j, k))
    shared = found = chunk_found = foreign_tokens = 0
    for i, (ids, is_shared) in enumerate(prompts):
        spans = [SegmentSpan(s, e, str(k)) for k, ((s, e), _) in enumerate(keyed[i])]

        def lookup(span: SegmentSpan, i=i):
            master = next(((j, k) for j, k in holders[keyed[i][int(span.hash)][1]] if j != i), None)
            return None if master is None else (master, span.end - span.start)

        def neighbour(master: tuple[int, int], before: bool):
            j, k = master
            near = k - 1 if before else k + 1
            if not 0 <= near < len(keyed[j]):
                return None
            (s, e), key = keyed[j][near]
            contiguous = e == keyed[j][k][0][0] if before else s == keyed[j][k][0][1]
            return ((j, near), key, e - s) if contiguous else None

        runs = plan_chunk(spans, lookup, 0, len(ids), len(ids) + 1, neighbour, ids)
        hit = [False] * len(ids)
        for run in runs.runs:
            hit[run.start:run.end] = [True] * len(run)
        whole = [False] * len(ids)
        for index in runs.found:
            whole[spans[index].start:spans[index].end] = [True] * (spans[index].end - spans[index].start)
        foreign_tokens += sum(e - s for (s, e), key in keyed[i] if key in foreign)
        shared += sum(is_shared)
        found += sum(h and m for h, m in zip(hit, is_shared))
        chunk_found += sum(h and m for h, m in zip(whole, is_shared))
    chunks = [e - s for k in keyed for (s, e), _ in k]
    return {"shared_tokens": shared, "found_tokens": found, "recall": found / shared if shared else None,
            "chunk_recall": chunk_found / shared if shared else None,
            "chunks_per_prompt": len(chunks) / len(prompts), "mean_chunk_tokens": statistics.fmean(chunks),
            "prompt_tokens": statistics.fmean(len(ids) for ids, _ in prompts), "foreign_tokens": foreign_tokens}


def recall_rows(args: argparse.Namespace, tokenizer) -> list[dict]:
    rows = []
    cases = [(preset, n, words) for preset in args.presets for n in args.num_agents for words in args.block_words]
    for preset, n, words in tqdm(cases, desc="recall", unit="workload"):
        config = preset_config(preset, num_agents=n, block_words=words, num_rounds=1, seed=args.seed)
        prompts = round_prompts(make_simulation(config), tokenizer)
        strangers = round_prompts(make_simulation(dataclasses.replace(config, seed=args.seed + 1)), tokenizer)
        for spacing in args.spacings:
            rule = ChunkRule(min_tokens=args.min_tokens, spacing=spacing, window=2, max_tokens=256)
            rows.append({"type": "recall", "preset": preset, "tuned_on": preset == TUNED_ON, "num_agents": n,
                         "block_words": words, "spacing": spacing, "default": spacing == DEFAULT_CHUNK_SPACING,
                         **recall_row(rule, prompts, strangers)})
    return rows


def unshared_prompts(args: argparse.Namespace, repeat: int) -> list[str]:
    """Prompts that share nothing with each other or with any other repeat's: each agent's
    private notes of a simulation of its own."""
    return [make_simulation(preset_config(TUNED_ON, num_agents=1, history_words=args.overhead_words,
                                          seed=10_000 + repeat * 100 + i)).agents[0].history
            for i in range(args.overhead_prompts)]


def timed(url: str, prompts: list[str]) -> float:
    start = time.perf_counter()
    for prompt in prompts:
        r = requests.post(url + "/generate", timeout=600, json={
            "text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        r.raise_for_status()
    return time.perf_counter() - start


def overhead_rows(args: argparse.Namespace) -> list[dict]:
    model = ["--model-path", args.model_path] if args.model_path else []
    rows = []
    with ServerProcess(model) as default, ServerProcess([*model, "--disable-tokendance"]) as disabled:
        timed(default.url, unshared_prompts(args, -1))  # warm both up
        timed(disabled.url, unshared_prompts(args, -1))
        for repeat in tqdm(range(args.overhead_repeats), desc="overhead", unit="repeat"):
            prompts = unshared_prompts(args, repeat)
            order = [(default, "default"), (disabled, "disabled")][:: 1 if repeat % 2 == 0 else -1]
            seconds = {}
            for server, name in order:
                flush_cache(server.url)
                seconds[name] = timed(server.url, prompts)
            rows.append({"type": "overhead", "repeat": repeat, "prompts": len(prompts),
                         "seconds_default": seconds["default"], "seconds_disabled": seconds["disabled"],
                         "ratio": seconds["disabled"] / seconds["default"]})
    return rows


def plot(path: Path, rows: list[dict]) -> None:
    recall = [r for r in rows if r["type"] == "recall"]
    cases = dict.fromkeys((r["preset"], r["num_agents"], r["block_words"]) for r in recall)

    def series(key: str) -> dict:
        return {f"{p} N={n} {w}w": ([r["spacing"] for r in recall if (r["preset"], r["num_agents"], r["block_words"])
                                     == (p, n, w)],
                                    [r[key] for r in recall if (r["preset"], r["num_agents"], r["block_words"])
                                     == (p, n, w)]) for p, n, w in cases}

    panels = [report.Panel("shared tokens found", "chunk spacing (tokens)", "recall", series("recall"), hline=0.9,
                           hline_label="target 0.9"),
              report.Panel("chunk length", "chunk spacing (tokens)", "mean tokens", series("mean_chunk_tokens"))]
    overhead = [r for r in rows if r["type"] == "overhead"]
    if overhead:
        panels.append(report.Panel("prompts sharing nothing: disabled / default latency", "repeat", "ratio",
                                   {"ratio": ([r["repeat"] for r in overhead], [r["ratio"] for r in overhead])},
                                   hline=0.98, hline_label="target 0.98"))
    report.plot_panels(path, "Content-defined chunks: shared text found without markers", panels)


def summary(rows: list[dict]) -> list[tuple[str, str]]:
    recall = [r for r in rows if r["type"] == "recall"]
    sections = [("Recall per workload and spacing (round 0, plain prompts)", report.markdown_table(recall, [
        "preset", "tuned_on", "num_agents", "block_words", "spacing", "default", "recall", "chunk_recall",
        "shared_tokens", "chunks_per_prompt", "mean_chunk_tokens", "prompt_tokens", "foreign_tokens"]))]
    overhead = [r for r in rows if r["type"] == "overhead"]
    if overhead:
        ratios = [r["ratio"] for r in overhead]
        line = (f"Ratio disabled / default over {len(ratios)} alternating repeats: "
                f"mean {statistics.fmean(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}.")
        sections.append(("Overhead on prompts that share nothing",
                         line + "\n\n" + report.markdown_table(overhead, ["repeat", "prompts", "seconds_default",
                                                                          "seconds_disabled", "ratio"])))
    return sections


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_content_chunks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated workload presets")
    p.add_argument("--num-agents", default="4,8", help="comma-separated round sizes")
    p.add_argument("--block-words", default="60,120", help="comma-separated shared block lengths (words)")
    p.add_argument("--spacings", default="4,8,16,32", help="comma-separated chunk spacings (powers of two)")
    p.add_argument("--min-tokens", type=int, default=16, help="--tokendance-min-segment-tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead-repeats", type=int, default=5, help="0: recall only, no server")
    p.add_argument("--overhead-prompts", type=int, default=8, help="prompts per repeat")
    p.add_argument("--overhead-words", type=int, default=300, help="words per overhead prompt")
    p.add_argument("--model-path", default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--output-file", type=Path, default=Path("benchmark/results/content_chunks.jsonl"),
                   help="JSONL; the Markdown summary and the PNG plot are written beside it")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        args.presets = args.presets.split(",")
        for preset in args.presets:
            preset_config(preset)
        args.num_agents, args.block_words, args.spacings = (
            [int(v) for v in getattr(args, name).split(",")] for name in ("num_agents", "block_words", "spacings"))
        for spacing in args.spacings:
            ChunkRule(min_tokens=args.min_tokens, spacing=spacing, window=2, max_tokens=256)
    except ValueError as e:
        p.error(str(e))
    if min(args.num_agents) < 2 or args.overhead_repeats < 0 or args.overhead_prompts < 1:
        p.error("--num-agents must be >= 2, --overhead-repeats >= 0, --overhead-prompts >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from sglang_tokendance.model_store import prepared_default_model

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path or str(prepared_default_model()))
    rows = recall_rows(args, tokenizer)
    if args.overhead_repeats:
        rows += overhead_rows(args)
    command = report.command_line("sglang_tokendance.bench_content_chunks", argv)
    report.write_jsonl(args.output_file, [{"type": "meta", "command": command}, *rows])
    report.write_markdown(args.output_file.with_suffix(".md"), "Content-defined chunks: recall and overhead",
                          command, summary(rows))
    if not args.no_plot:
        plot(args.output_file.with_suffix(".png"), rows)


if __name__ == "__main__":
    main()
