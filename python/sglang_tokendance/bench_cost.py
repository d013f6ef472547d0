"""`python -m sglang_tokendance.bench_cost`: where blending one request pays -- prefill time against its reused share.

One request at a time: a prompt of private (fresh) text, then one marked block holding a share
of its words, then a short instruction. The block was cached beforehand by an author prompt
that holds it after other text, so the reader reads it at another offset (approximate reuse,
never a radix hit). Every mode's server is up at once and each case runs on every mode in turn
(the order rotating with the repeat), so drift on a shared machine hits them alike; only the
reader is timed (one output token). Per prompt length and share: the median prefill time per
mode over stock radix's, the block tokens blended or fallen back (core/cost), and core/cost's
estimate of SGLang's path over the blended one -- the model the cost check decides by.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests
from tqdm import tqdm

from sglang_tokendance.bench import report
from sglang_tokendance.bench.machine import idle_check
from sglang_tokendance.bench.multiagent import MODES, Mode
from sglang_tokendance.bench.server_process import ServerProcess
from sglang_tokendance.bench_multiagent import model_layers
from sglang_tokendance.core.cost import PrefillCost, serving_cost
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR
from sglang_tokendance.core.selection import rule_named
from sglang_tokendance.server_args import TokenDanceArgs

WORDS = ("harbor river stone market lantern meadow copper orchard candle bridge forest valley letter window "
         "thunder silver garden morning quiet ledger").split()


@dataclass(frozen=True)
class Case:
    words: int  # the reader's prompt length in words
    share: float  # of them in the block
    repeat: int
    author: list[str]  # pieces: other text, the block (marked)
    reader: list[str]  # pieces: private text, the block (marked), the instruction; one piece without a block


@dataclass
class Sample:
    mode: str
    words: int
    share: float
    repeat: int
    prefill_s: float
    prompt_tokens: int
    block_tokens: int  # the reader's marked block (TokenDance modes; 0 for stock)
    block_start: int  # its first token's position
    reused_tokens: int
    recomputed_tokens: int
    cost_fallback_tokens: int


def text(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(words))


def make_cases(lengths: list[int], shares: list[float], repeats: int, seed: int) -> list[Case]:
    rng, cases = random.Random(seed), []
    for repeat in range(repeats):
        for words in lengths:
            for share in shares:
                block_words = round(words * share)
                private, instruction = text(rng, words - block_words), text(rng, 6)
                if block_words:
                    block = text(rng, block_words)
                    cases.append(Case(words, share, repeat, [text(rng, 12), block, ""], [private, block, instruction]))
                else:
                    cases.append(Case(words, share, repeat, [], [f"{private} {instruction}"]))
    return cases


def generate(url: str, pieces: list[str], mode: Mode) -> tuple[float, dict]:
    prompt = (DEFAULT_SEPARATOR if mode.marked else " ").join(pieces)
    start = time.perf_counter()
    resp = requests.post(url + "/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0}}, timeout=600)
    if resp.status_code != 200:
        raise RuntimeError(f"/generate answered {resp.status_code}: {resp.text}")
    return time.perf_counter() - start, resp.json()["meta_info"]


def run_case(url: str, mode: Mode, case: Case) -> Sample:
    if case.author:
        generate(url, case.author, mode)
    seconds, meta = generate(url, case.reader, mode)
    info = meta.get("tokendance") or {}
    spans = info.get("segments", []) if case.author else []  # an unmarked reader's content chunks are no block
    return Sample(mode.name, case.words, case.share, case.repeat, seconds, meta["prompt_tokens"],
                  sum(s["end"] - s["start"] for s in spans), spans[0]["start"] if spans else 0,
                  info.get("reused_tokens", 0), info.get("recomputed_tokens", 0), info.get("cost_fallback_tokens", 0))


def summary(samples: list[Sample], modes: list[Mode], server: ServerShape) -> list[dict]:
    """Per prompt length, share and mode: medians, the speedup over radix (the first mode
    without radix), and core/cost's estimate of SGLang's work over the mode's."""
    rows = []
    for words, share in dict.fromkeys((s.words, s.share) for s in samples):
        def of(name: str) -> list[Sample]:
            return [s for s in samples if (s.words, s.share, s.mode) == (words, share, name)]

        base = statistics.median(s.prefill_s for s in of("radix" if of("radix") else modes[0].name))
        for mode in modes:
            mine = of(mode.name)
            tokens = round(statistics.median(s.prompt_tokens for s in mine))
            block = round(statistics.median(s.block_tokens for s in mine))
            seconds = statistics.median(s.prefill_s for s in mine)
            row = {"mode": mode.name, "words": words, "share": share, "prompt_tokens": tokens, "block_tokens": block,
                   "blended_tokens": round(statistics.mean(s.reused_tokens + s.recomputed_tokens for s in mine)),
                   "fallback_tokens": round(statistics.mean(s.cost_fallback_tokens for s in mine)),
                   "median_prefill_s": seconds, "speedup": base / seconds, "estimated_speedup": None}
            if not mode.stock and block:
                start = round(statistics.median(s.block_start for s in mine))
                row["estimated_speedup"] = server.estimated_speedup(mode, tokens, start, start + block)
            rows.append(row)
    return rows


@dataclass(frozen=True)
class ServerShape:
    """What core/cost's estimate needs of the servers: the model's layers, SGLang's
    chunked-prefill size and the TokenDance server's attention backend."""

    layers: int
    chunk: int
    backend: str | None

    def cost_of(self, mode: Mode) -> tuple[PrefillCost, bool]:
        """The mode's cost model, and whether its server checks it (blends only where it pays)."""
        parser = argparse.ArgumentParser()
        TokenDanceArgs.add_cli_args(parser)
        args = TokenDanceArgs.from_cli_args(parser.parse_known_args(list(mode.server_args))[0])
        cost = serving_cost(self.layers, args.blend_options(), rule_named(args.selection).needs_attention,
                            self.backend)
        return cost, args.cost_check

    def estimated_speedup(self, mode: Mode, tokens: int, block_start: int, block_end: int) -> float:
        """SGLang's work over the mode's for a prompt whose block is [block_start, block_end),
        chunk by chunk as the server plans it (the last token never reused; a checked chunk
        whose blending would not pay takes SGLang's path)."""
        cost, checked = self.cost_of(mode)
        stock = ours = 0.0
        for start in range(0, tokens, self.chunk):
            end = min(tokens, start + self.chunk)
            reused = max(0, min(end, block_end, tokens - 1) - max(start, block_start))
            sglang = cost.stock(start, end - start)
            blended = cost.blended(start, end - start, reused) if reused else sglang
            stock, ours = stock + sglang, ours + (sglang if checked and blended >= sglang else blended)
        return stock / ours


def server_shape(url: str | None, model_path: str | None) -> ServerShape:
    """The servers' chunked-prefill size and attention backend, from a TokenDance server's /server_info."""
    info = requests.get(url + "/server_info", timeout=60).json() if url else {}
    chunk = info.get("chunked_prefill_size") or -1
    backend = info.get("prefill_attention_backend") or info.get("attention_backend")
    return ServerShape(model_layers(model_path), chunk if chunk > 0 else 1 << 30, backend)


def plot(path: Path, rows: list[dict], modes: list[Mode]) -> None:
    """One panel per prompt length: each mode's speedup over radix against the block's share,
    beside core/cost's estimate of it."""
    panels = []
    for words in dict.fromkeys(r["words"] for r in rows):
        mine = [r for r in rows if r["words"] == words]
        series = {m.name: ([r["share"] for r in mine if r["mode"] == m.name],
                           [r["speedup"] for r in mine if r["mode"] == m.name]) for m in modes}
        for m in modes:
            estimated = [r for r in mine if r["mode"] == m.name and r["estimated_speedup"] is not None]
            if estimated:
                series[f"{m.name} (core/cost's estimate)"] = ([r["share"] for r in estimated],
                                                               [r["estimated_speedup"] for r in estimated])
        panels.append(report.Panel(f"{words} words (~{mine[0]['prompt_tokens']} tokens)", "block share of the prompt",
                                   "radix's prefill time / the mode's", series, hline=1.0, hline_label="radix"))
    report.plot_panels(path, "One request's prefill against its reused share", panels)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="radix,tokendance,tokendance-always",
                   help=f"systems compared, all up at once (from {', '.join(MODES)})")
    p.add_argument("--prompt-words", default="150,600,1500", help="reader prompt lengths, in words")
    p.add_argument("--shares", default="0,0.02,0.1,0.25,0.5", help="the block's share of the words")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--model-path", default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--output-file", type=Path, default=Path("benchmark/results/cost.jsonl"))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    modes = [MODES[m] for m in args.modes.split(",")]
    cases = make_cases([int(w) for w in args.prompt_words.split(",")], [float(s) for s in args.shares.split(",")],
                       args.repeats, args.seed)
    extra = [*(["--model-path", args.model_path] if args.model_path else []), *args.server_args.split()]
    samples, idles = [], []
    with contextlib.ExitStack() as stack:
        urls = {m.name: stack.enter_context(ServerProcess([*m.server_args, *extra], stock=m.stock)).url
                for m in modes}
        for m in modes:  # warm-up, untimed
            generate(urls[m.name], [text(random.Random(0), 40)], m)
        for i, case in enumerate(tqdm(cases, desc="cases", unit="case")):
            if i % len(args.shares.split(",")) == 0:
                idles.append({"repeat": case.repeat, "words": case.words, **idle_check()})
            order = modes[case.repeat % len(modes):] + modes[:case.repeat % len(modes)]
            samples += [run_case(urls[m.name], m, case) for m in order]
        shape = server_shape(next((urls[m.name] for m in modes if not m.stock), None), args.model_path)
    rows = summary(samples, modes, shape)
    command = report.command_line("sglang_tokendance.bench_cost", argv)
    report.write_jsonl(args.output_file, [{"type": "meta", "command": command},
                                          *({"type": "sample", **asdict(s)} for s in samples),
                                          *({"type": "idle", **i} for i in idles),
                                          *({"type": "summary", **r} for r in rows)])
    if not args.no_plot:
        plot(Path(f"{args.output_file.with_suffix('')}_speedup.png"), rows, modes)
    columns = ["mode", "words", "share", "prompt_tokens", "block_tokens", "blended_tokens", "fallback_tokens",
               "median_prefill_s", "speedup", "estimated_speedup"]
    md = args.output_file.with_suffix(".md")
    report.write_markdown(md, "One request's prefill against its reused share", command, [
        ("Machine idle before each prompt length", report.markdown_table(idles, ["repeat", "words",
                                                                                "cpu_busy_fraction", "idle"])),
        ("Median prefill time over stock radix's (speedup), blocks blended or fallen back, and core/cost's "
         "estimate of SGLang's work over the blended path's", report.markdown_table(rows, columns))])
    print(md.read_text())


if __name__ == "__main__":
    main()
