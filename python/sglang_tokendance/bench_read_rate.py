"""`python -m sglang_tokendance.bench_read_rate`: what a reused token's KV costs per layer under each
storage: the two rates core/cost prices blending with (`WorkRates.restore`, `WorkRates.read`).

Dense storage restores a reused token before the forward: its Master's K (un-rotated) and V are
gathered from the Master's slots, K is rotated to the reader's position, and both are written
into the reader's own slots (srt/kv_copy.copy_kv through PoolKeys.pooled), once. Mirror storage
restores nothing: each layer's attention gathers the token's K from the Master's slots and
rotates it by its shift (core/rope_attention.ShiftedReads.shift_); V is read where it lies.

Both are timed here on the served model's KV shape (its layers, KV heads and head dim from its
config; no weights are loaded), at --tokens reused tokens, each repeat timing both in turn
(which goes first alternates): the ratio read / restore per token and layer, and the read rate
it implies from the restore rate core/cost was given. The restore rate itself was measured
against SGLang's forward (core/cost's notes); this ratio is what ties the read rate to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from tqdm import tqdm

from sglang_tokendance.bench import report
from sglang_tokendance.bench.machine import idle_check
from sglang_tokendance.core.cost import WorkRates
from sglang_tokendance.core.rope_attention import ShiftedReads
from sglang_tokendance.core.slot_frames import SlotFrames
from sglang_tokendance.srt.kv_copy import PoolKeys, copy_kv, serving_rope_spec

DEFAULT_OUTPUT = Path("benchmark/results/read_rate.jsonl")


def kv_pool(config: dict, slots: int, dtype: torch.dtype) -> SimpleNamespace:
    """A KV pool of `slots` slots in the model's shape, as SGLang's pool exposes it."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    shape = (slots + 1, config.get("num_key_value_heads") or heads, head_dim)
    keys = [torch.randn(shape, dtype=dtype) for _ in range(config["num_hidden_layers"])]
    values = [torch.randn(shape, dtype=dtype) for _ in range(config["num_hidden_layers"])]
    return SimpleNamespace(start_layer=0, layer_num=len(keys), get_key_buffer=keys.__getitem__,
                           get_value_buffer=values.__getitem__)


def timed(work: Callable[[], None]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def measure(config: dict, tokens: int, repeats: int, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Per repeat: seconds per token and layer of a dense restore and of a mirror read of
    `tokens` reused tokens (a Master written at positions 0.., read at `tokens`.. on)."""
    pool = kv_pool(config, 2 * tokens, dtype)
    spec = serving_rope_spec(config)
    master, row = torch.arange(1, tokens + 1), torch.arange(tokens + 1, 2 * tokens + 1)
    positions = torch.arange(tokens, 2 * tokens)
    frames = SlotFrames(2 * tokens)
    frames.record(master, torch.arange(tokens))
    reads = ShiftedReads(spec, frames)
    shifts = reads.shifts(master, positions)
    layers = range(pool.layer_num)

    def restore() -> None:
        copy_kv(pool, master, row, positions, PoolKeys(spec).pooled)

    def read() -> None:
        for layer in layers:
            reads.shift_(pool.get_key_buffer(layer)[master], shifts)

    restore()  # warm-up: the rotation tables built, allocations made
    read()
    samples = []
    for repeat in tqdm(range(repeats), desc="repeats", unit="repeat"):
        order = (restore, read) if repeat % 2 == 0 else (read, restore)
        seconds = {work.__name__: timed(work) / (tokens * pool.layer_num) for work in order}
        samples.append({"repeat": repeat, "restore_s": seconds["restore"], "read_s": seconds["read"],
                        "ratio": seconds["read"] / seconds["restore"]})
    return samples


def summary(samples: list[dict], rates: WorkRates = WorkRates()) -> dict:
    ratios = [s["ratio"] for s in samples]
    ratio = statistics.median(ratios)
    return {"ratio": ratio, "ratio_min": min(ratios), "ratio_max": max(ratios),
            "restore_us": 1e6 * statistics.median(s["restore_s"] for s in samples),
            "read_us": 1e6 * statistics.median(s["read_s"] for s in samples),
            "implied_read_rate": ratio * rates.restore, "restore_rate": rates.restore, "read_rate": rates.read}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_read_rate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="whose config.json gives the KV shape and RoPE "
                   "(default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=1000, help="reused tokens per timing")
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--output-file", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        p.error("--tokens and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.model_path is None:
        from sglang_tokendance.model_store import prepared_default_model

        args.model_path = str(prepared_default_model())
    config = json.loads((Path(args.model_path) / "config.json").read_text())
    idle = idle_check()
    samples = measure(config, args.tokens, args.repeats)
    row = {"tokens": args.tokens, "layers": config["num_hidden_layers"], "threads": torch.get_num_threads(),
           **summary(samples)}
    command = report.command_line("sglang_tokendance.bench_read_rate", argv)
    report.write_jsonl(args.output_file, [{"type": "meta", "command": command, **idle},
                                          *({"type": "sample", **s} for s in samples),
                                          {"type": "summary", **row}])
    if not args.no_plot:
        measured = ([s["repeat"] for s in samples], [s["ratio"] for s in samples])
        report.plot_lines(args.output_file.with_suffix(".png"), "Mirror read / dense restore, per token and layer",
                          "repeat", "ratio", {"measured": measured},
                          hline=row["read_rate"] / row["restore_rate"], hline_label="core/cost's rates")
    md = args.output_file.with_suffix(".md")
    report.write_markdown(md, "Reading a reused token in place against restoring it", command, [
        ("Machine idle before the run", report.markdown_table([idle], ["cpu_busy_fraction", "idle"])),
        ("Medians per token and layer (us), the ratio over the repeats, and the read rate it implies from "
         "core/cost's restore rate", report.markdown_table([row], list(row)))])
    print(md.read_text())


if __name__ == "__main__":
    main()
