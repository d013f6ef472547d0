"""`python -m sglang_tokendance.bench_projection`: what the measured memory saving means for a
large model on one GPU, on paper.

Reads a `bench_multiagent --capacity fit` run (JSONL): the round's shape per agent where it
fitted the most agents -- private tokens p (prompt less reused positions), shared block tokens
b (reused positions / N: every prompt holds the round's N blocks), new tokens g -- and each
mode's per-Mirror compression c (reused positions per own slot). A round of N agents then holds

    stock radix, dense copies:  N (p + N b + g)            every agent its own copy of every block
    Master-Mirror storage:      N (p + N b / c + g) + N b  own slots, plus one Master per block

KV tokens at its peak (both grow as N^2: every prompt holds N blocks, so the largest round grows
as sqrt(c), not c). The model is checked against the measured peak per agent first
(`model_vs_measured`), then applied to a large model's KV pool: bytes per token = 2 (K, V) x
layers x KV heads x head dim x dtype bytes; pool = GPU memory x SGLang's --mem-fraction-static
less the weights. Defaults: Qwen2.5-7B (28 layers, 4 KV heads, head dim 128, bf16, 15.2 GB of
weights) on one 80 GB GPU at --mem-fraction-static 0.88. Token counts come from the measured
run's tokenizer (SmolLM2's; Qwen's counts English text within a few percent of it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from sglang_tokendance.bench import report

DEFAULT_INPUT = Path("benchmark/results/capacity_fit.jsonl")


@dataclass(frozen=True)
class RoundShape:
    """One agent's tokens in a round of N: private p, per shared block b, new g."""

    private: float
    block: float
    new: float

    def kv_tokens(self, n: int, compression: float) -> float:
        """A round's KV tokens at its peak; compression 1: own copies, no Master read in place."""
        if compression == 1.0:
            return n * (self.private + n * self.block + self.new)
        return n * (self.private + n * self.block / compression + self.new) + n * self.block

    def largest_round(self, pool_tokens: float, compression: float) -> int:
        """The most agents one round can hold in `pool_tokens`."""
        n = 1
        while self.kv_tokens(n + 1, compression) <= pool_tokens:
            n += 1
        return n if self.kv_tokens(n, compression) <= pool_tokens else 0


@dataclass(frozen=True)
class Device:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    gpu_gb: float
    mem_fraction_static: float
    weights_gb: float

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def pool_tokens(self) -> int:
        pool_bytes = (self.gpu_gb * self.mem_fraction_static - self.weights_gb) * 1e9
        if pool_bytes <= 0:
            raise ValueError(f"no KV pool: {self.gpu_gb} GB x {self.mem_fraction_static} leaves nothing past "
                             f"{self.weights_gb} GB of weights")
        return int(pool_bytes // self.bytes_per_token)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_projection", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-file", type=Path, default=DEFAULT_INPUT, help="a bench_multiagent --capacity fit JSONL")
    p.add_argument("--num-agents", default="10,50,100", help="round sizes to project")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--gpu-gb", type=float, default=80.0)
    p.add_argument("--mem-fraction-static", type=float, default=0.88)
    p.add_argument("--weights-gb", type=float, default=15.23)
    p.add_argument("--output-file", type=Path, default=Path("benchmark/results/projection_qwen2.5_7b.jsonl"))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.agents = [int(n) for n in args.num_agents.split(",")]
    if min(args.agents) < 1:
        p.error(f"--num-agents must be positive, got {args.num_agents}")
    return args


def measured(path: Path) -> tuple[RoundShape, dict[str, dict]]:
    """The round's shape (from the reusing modes' probes at their most agents) and, per mode, its
    fitted row with the measured peak per agent at its most agents."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    rows = {r["mode"]: r for r in records if r["type"] == "capacity_fit"}
    if not rows:
        raise ValueError(f"{path} holds no capacity_fit rows (run bench_multiagent --capacity fit)")
    probes = [r for r in records if r["type"] == "fit_probe" and r["fits"] and r["reused_positions_per_agent"]
              and r["num_agents"] == rows[r["mode"]]["max_agents"]]
    if not probes:
        raise ValueError(f"{path}: no reusing mode fitted a round, so the round's shape is unknown")

    def mean(value) -> float:
        return sum(value(p) for p in probes) / len(probes)

    reused = mean(lambda p: p["reused_positions_per_agent"])
    shape = RoundShape(private=mean(lambda p: p["prompt_tokens_per_agent"]) - reused,
                       block=mean(lambda p: p["reused_positions_per_agent"] / p["num_agents"]),
                       new=mean(lambda p: p["completion_tokens_per_agent"]))
    return shape, rows


def compression_of(row: dict) -> float:
    """Reused positions per own slot: 1 for dense copies and for stock SGLang (which reuses none)."""
    c = row["mirror_compression"]
    return 1.0 if c is None or math.isnan(c) else c


def project(args, shape: RoundShape, rows: dict[str, dict], device: Device) -> list[dict]:
    out = []
    for mode, row in rows.items():
        c = compression_of(row)
        n_fit = int(row["max_agents"])
        base = {"mode": mode, "compression": c,
                "model_vs_measured": shape.kv_tokens(n_fit, c) / n_fit / row["peak_kv_tokens_per_agent"]
                if n_fit and row["peak_kv_tokens_per_agent"] else float("nan"),
                "largest_round": shape.largest_round(device.pool_tokens, c)}
        for n in args.agents:
            tokens = shape.kv_tokens(n, c)
            out.append({**base, "num_agents": n, "kv_tokens_per_agent": tokens / n,
                        "round_kv_gb": tokens * device.bytes_per_token / 1e9,
                        "rounds_at_once": int(device.pool_tokens // tokens)})
    by_n = {(r["mode"], r["num_agents"]): r for r in out}
    for r in out:
        stock = by_n.get(("radix", r["num_agents"]))
        r["rounds_vs_radix"] = r["rounds_at_once"] / stock["rounds_at_once"] if stock and stock["rounds_at_once"] \
            else float("nan")
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = Device(args.layers, args.kv_heads, args.head_dim, args.dtype_bytes, args.gpu_gb,
                    args.mem_fraction_static, args.weights_gb)
    shape, rows = measured(args.input_file)
    table = project(args, shape, rows, device)
    meta = {"type": "meta", "input": str(args.input_file), "shape": asdict(shape), "device": asdict(device),
            "bytes_per_token": device.bytes_per_token, "pool_tokens": device.pool_tokens}
    report.write_jsonl(args.output_file, [meta, *({"type": "projection", **r} for r in table)])
    if not args.no_plot:
        ns = list(range(1, max(args.agents) + 1))
        report.plot_lines(args.output_file.with_suffix(".png"), "One round's KV at its peak", "agents in the round",
                          "GB", {mode: (ns, [shape.kv_tokens(n, compression_of(row)) * device.bytes_per_token / 1e9
                                             for n in ns]) for mode, row in rows.items()},
                          hline=device.pool_tokens * device.bytes_per_token / 1e9, hline_label="KV pool")
    assumptions = report.markdown_table([{**asdict(shape), "bytes_per_token": device.bytes_per_token,
                                          "pool_tokens": device.pool_tokens, **asdict(device)}],
                                        ["private", "block", "new", "bytes_per_token", "pool_tokens", "gpu_gb",
                                         "mem_fraction_static", "weights_gb"])
    md = args.output_file.with_suffix(".md")
    report.write_markdown(md, "Projection: a round's KV on one GPU", report.command_line(
        "sglang_tokendance.bench_projection", argv), [
        ("Model", __doc__.split("\n\n", 1)[1].strip()),
        ("Measured shape and device", assumptions),
        ("Projection", report.markdown_table(table, [
            "mode", "num_agents", "compression", "kv_tokens_per_agent", "round_kv_gb", "rounds_at_once",
            "rounds_vs_radix", "largest_round", "model_vs_measured"]))])
    print(md.read_text())


if __name__ == "__main__":
    main()
