"""Benchmark output: JSONL of raw records, a Markdown summary that starts with the exact
command, and matplotlib PNG plots."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Iterable


def command_line(module: str, argv: list[str]) -> str:
    """The exact command that produced a result, for its Markdown summary."""
    return " ".join([f"python -m {module}", *(shlex.quote(a) for a in argv)])


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_markdown(path: Path, title: str, command: str, sections: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title}", "", "Command:", "", "```bash", command, "```", ""]
    for heading, body in sections:
        parts += [f"## {heading}", "", body, ""]
    path.write_text("\n".join(parts))


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str,
               series: dict[str, tuple[list[float], list[float]]], hline: float | None = None,
               hline_label: str = "", logy: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", markersize=3, label=name)
    if hline is not None:
        ax.axhline(hline, linestyle="--", color="gray", label=hline_label)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_fractions(path: Path, rows: list[dict[str, Any]]) -> None:
    """Prefill time fraction (solid) beside work fraction (dashed) against N, one colour per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for i, mode in enumerate(modes):
        mine = [r for r in rows if r["mode"] == mode]
        xs = [r["num_agents"] for r in mine]
        ax.plot(xs, [r["time_fraction"] for r in mine], marker="o", color=f"C{i}", label=f"{mode}: time")
        ax.plot(xs, [r["work_fraction"] for r in mine], marker="x", linestyle="--", color=f"C{i}",
                label=f"{mode}: work")
    ax.set_xticks(sorted({r["num_agents"] for r in rows}))
    ax.set_title("Prefill of rounds with reuse, as a fraction of a full prefill")
    ax.set_xlabel("agents per round (N)")
    ax.set_ylabel("time / radix's (solid), token-layers / full (dashed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
