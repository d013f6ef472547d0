"""`python -m sglang_tokendance.bench_decode`: one decode step's attention when rows read Masters
in place, against SGLang's own decode over rows that hold their own copies.

A batch of rows, each `length` tokens: its own text at the start and the end, and between them
`--runs` shared blocks, each one Master (one set of slots, written once by an author at other
positions) that every row reads at a shift of its own. Three layouts of the same keys, timed
over `--layers` layers (each its own buffers, as a model's), in one process:

* `sglang`: stock SGLang's layout -- every row its own copies at its own positions --
  through TorchNativeAttnBackend's decode, the path the tokendance backend leaves untouched;
* `rotate-all`: Masters' K kept un-rotated and every key rotated as it is read (the mirror
  storage this replaces);
* `frames`: K kept where its author rotated it, keys read by tiles of one shift, the query
  rotated once per tile (core/rope_attention), plus the tile plan a forward makes once
  (`plan_ms`, host work, counted in the step).

All three must give the same attention output (`max_abs_diff`, checked); the step time ratios
are against `sglang`, measured in one run. The machine's idleness is checked first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sglang_tokendance import cpu
from sglang_tokendance.bench import report
from sglang_tokendance.bench.machine import idle_check
from sglang_tokendance.core.rope import RopeSpec, rotate
from sglang_tokendance.core.rope_attention import (
    ShiftedReads,
    decode_tiles,
    extend_grids,
    row_attention,
    tiled_decode_attention,
)
from sglang_tokendance.core.slot_frames import SlotFrames


@dataclass(frozen=True)
class Shape:
    """The model's attention (SmolLM2-135M by default) and the batch."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    batch: int
    runs: int  # shared blocks per row
    shared: float  # their share of a row
    tile: int


class Layouts:
    """One batch's keys in the three layouts, one buffer set per layer. Row b's own text runs
    b tokens shorter at its start than row 0's, so each row reads each Master at a shift of its
    own; the author wrote Master r at positions 3 + r * run."""

    def __init__(self, shape: Shape, length: int, spec: RopeSpec, seed: int):
        gen = torch.Generator().manual_seed(seed)
        batch, runs = shape.batch, shape.runs
        run = max(1, int(length * shape.shared) // runs)
        head = (length - runs * run) // 2
        self.length, self.scale = length, shape.head_dim ** -0.5
        self.row_index = torch.arange(batch)
        self.table = torch.arange(1, batch * length + 1, dtype=torch.int32).view(batch, length)  # stock: own copies
        # mirror: the runs' positions point at the Masters' slots, the rest at slots of the row's own
        master_of = torch.full((batch, length), -1)
        for b in range(batch):
            at = max(0, head - b)
            master_of[b, at:at + runs * run] = torch.arange(runs * run)
        own = master_of < 0
        self.mirror_table = torch.zeros(batch, length, dtype=torch.int64)
        self.mirror_table[own] = torch.arange(1, int(own.sum()) + 1)
        self.mirror_table[~own] = int(own.sum()) + 1 + master_of[~own]
        slots = int(own.sum()) + runs * run
        self.frames = SlotFrames(slots)
        self.frames.record(self.mirror_table[own], own.nonzero()[:, 1])
        masters = torch.arange(runs * run)
        self.frames.record(int(own.sum()) + 1 + masters, 3 + masters)
        self.unrotated_frames = SlotFrames(slots)  # rotate-all: every key kept at frame 0
        positions = torch.arange(length).repeat(batch)
        flat = self.mirror_table.flatten()
        self.dense, self.mirror, self.unrotated, self.q = [], [], [], []
        for _ in tqdm(range(shape.layers), desc=f"layers of {length}-token rows", unit="layer", leave=False):
            k = torch.randn(batch, length, shape.kv_heads, shape.head_dim, generator=gen)  # before RoPE
            v = torch.randn(batch, length, shape.kv_heads, shape.head_dim, generator=gen)
            shared_k = torch.randn(runs * run, shape.kv_heads, shape.head_dim, generator=gen)
            shared_v = torch.randn(runs * run, shape.kv_heads, shape.head_dim, generator=gen)
            k[~own], v[~own] = shared_k[master_of[~own]], shared_v[master_of[~own]]
            k, v = k.flatten(0, 1), v.flatten(0, 1)
            dense_k, dense_v = (k.new_zeros(batch * length + 1, *k.shape[1:]) for _ in range(2))
            dense_k[1:], dense_v[1:] = rotate(k, positions, spec), v
            mirror_k, mirror_v, plain_k = (k.new_zeros(slots + 1, *k.shape[1:]) for _ in range(3))
            mirror_k[flat] = rotate(k, self.frames.frame[flat], spec)
            mirror_v[flat], plain_k[flat] = v, k
            self.dense.append((dense_k, dense_v))
            self.mirror.append((mirror_k, mirror_v))
            self.unrotated.append((plain_k, mirror_v))
            self.q.append(torch.randn(batch, shape.heads, shape.head_dim, generator=gen))
        self.distinct_shifts = self.frames.shifts(self.mirror_table).unique().numel()


def sglang_decode(layouts: Layouts, heads: int, kv_heads: int):
    """TorchNativeAttnBackend's own decode (an instance without a model runner: the method
    reads nothing of it but its arguments)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    lengths = torch.full((layouts.table.shape[0],), layouts.length)

    def step() -> list[torch.Tensor]:
        outs = []
        for q, (keys, values) in zip(layouts.q, layouts.dense):
            out = torch.empty_like(q)
            outs.append(backend._run_sdpa_forward_decode(q, out, keys, values, layouts.table, layouts.row_index,
                                                         lengths, scaling=layouts.scale,
                                                         enable_gqa=heads != kv_heads))
        return outs
    return step


def rotate_all_decode(layouts: Layouts, spec: RopeSpec):
    reads = ShiftedReads(spec, layouts.unrotated_frames)
    n = layouts.length

    def step() -> list[torch.Tensor]:
        grids = extend_grids(layouts.mirror_table, layouts.row_index, [n - 1] * len(layouts.row_index),
                             [1] * len(layouts.row_index))
        return [row_attention(grids, q, keys, values, layouts.scale, reads)
                for q, (keys, values) in zip(layouts.q, layouts.unrotated)]
    return step


def frames_decode(layouts: Layouts, spec: RopeSpec, tile: int, plan_ms: list[float]):
    reads = ShiftedReads(spec, layouts.frames)

    def step() -> list[torch.Tensor]:
        start = time.perf_counter()
        tiles = decode_tiles(layouts.mirror_table, layouts.row_index, [layouts.length] * len(layouts.row_index),
                             reads, largest_tile=tile)
        plan_ms.append(1e3 * (time.perf_counter() - start))
        return [tiled_decode_attention(q, keys, values, tiles, layouts.scale, reads)
                for q, (keys, values) in zip(layouts.q, layouts.mirror)]
    return step


def measure(shape: Shape, spec: RopeSpec, length: int, repeats: int, seed: int) -> tuple[list[dict], dict]:
    """Per path: the median step time over `repeats` (after one warm-up), and its outputs'
    largest difference from SGLang's."""
    layouts = Layouts(shape, length, spec, seed)
    plan_ms: list[float] = []
    paths = {"sglang": sglang_decode(layouts, shape.heads, shape.kv_heads),
             "rotate-all": rotate_all_decode(layouts, spec),
             "frames": frames_decode(layouts, spec, shape.tile, plan_ms)}
    outputs = {name: step() for name, step in paths.items()}  # warm-up, and the outputs compared
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(repeats):
        order = list(paths)[i % len(paths):] + list(paths)[:i % len(paths)]  # drift hits each path alike
        for name in order:
            start = time.perf_counter()
            paths[name]()
            times[name].append(1e3 * (time.perf_counter() - start))
    base = statistics.median(times["sglang"])
    rows = []
    for name in paths:
        diff = max(float((a - b).abs().max()) for a, b in zip(outputs[name], outputs["sglang"]))
        ms = statistics.median(times[name])
        rows.append({"path": name, "length": length, "step_ms": ms, "over_sglang": ms / base, "max_abs_diff": diff,
                     "plan_ms": statistics.median(plan_ms[1:] or plan_ms) if name == "frames" else None})
    return rows, {"length": length, "distinct_shifts": layouts.distinct_shifts, "samples": times}


def plot(path: Path, rows: list[dict]) -> None:
    paths = list(dict.fromkeys(r["path"] for r in rows))
    series = {p: ([r["length"] for r in rows if r["path"] == p], [r["step_ms"] for r in rows if r["path"] == p])
              for p in paths}
    ratios = {p: ([r["length"] for r in rows if r["path"] == p], [r["over_sglang"] for r in rows if r["path"] == p])
              for p in paths if p != "sglang"}
    report.plot_panels(path, "One decode step's attention, rows reading Masters in place", [
        report.Panel("step time", "tokens per row", "ms (all layers)", series, logy=True),
        report.Panel("over SGLang's own decode", "tokens per row", "time / sglang's", ratios, hline=1.0,
                     hline_label="sglang")])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="256,512,1024,2048,4096", help="tokens per row")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rope-theta", type=float, default=100000.0)
    p.add_argument("--runs", type=int, default=4, help="shared blocks (Masters) per row")
    p.add_argument("--shared", type=float, default=0.7, help="their share of a row")
    p.add_argument("--tile", type=int, default=256, help="most keys per tile of the frames path")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", type=Path, default=Path("benchmark/results/decode_shifted.jsonl"))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads or not 0 < args.shared < 1 or args.runs < 1 or args.tile < 1:
        p.error("--heads must be a multiple of --kv-heads, 0 < --shared < 1, --runs and --tile >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cpu.prepare_process()
    shape = Shape(args.heads, args.kv_heads, args.head_dim, args.layers, args.batch, args.runs, args.shared,
                  args.tile)
    spec = RopeSpec(args.head_dim, args.head_dim, args.rope_theta)
    idle = idle_check()
    rows, details = [], []
    for length in tqdm([int(n) for n in args.lengths.split(",")], desc="lengths", unit="length"):
        mine, detail = measure(shape, spec, length, args.repeats, args.seed)
        rows += mine
        details.append(detail)
    command = report.command_line("sglang_tokendance.bench_decode", argv)
    report.write_jsonl(args.output_file, [{"type": "meta", "command": command, "idle": idle,
                                           "threads": torch.get_num_threads(), **vars(shape)},
                                          *({"type": "detail", **d} for d in details),
                                          *({"type": "summary", **r} for r in rows)])
    if not args.no_plot:
        plot(args.output_file.with_suffix(".png"), rows)
    md = args.output_file.with_suffix(".md")
    report.write_markdown(md, "One decode step's attention, rows reading Masters in place", command, [
        ("Machine", report.markdown_table([{**idle, "threads": torch.get_num_threads()}],
                                          ["cpu_busy_fraction", "idle", "threads"])),
        (f"Median step time over {args.layers} layers, batch {args.batch}, {args.runs} Masters per row "
         f"({args.shared:.0%} of it); ratios against SGLang's own decode in the same run",
         report.markdown_table(rows, ["path", "length", "step_ms", "over_sglang", "plan_ms", "max_abs_diff"]))])
    print(md.read_text())


if __name__ == "__main__":
    main()
