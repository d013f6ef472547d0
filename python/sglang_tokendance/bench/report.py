"""Benchmark output: JSONL of raw records, a Markdown summary that starts with the exact
command, and matplotlib PNG plots."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
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
        if v is None:
            return "–"
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


@dataclass
class Panel:
    """One axes of a figure: named (x, y) series, optionally a dashed reference line, log y,
    points without lines, and the diagonal y = x (for server-vs-in-process scatter plots)."""

    title: str
    xlabel: str
    ylabel: str
    series: dict[str, tuple[list[float], list[float]]]
    hline: float | None = None
    hline_label: str = ""
    logy: bool = False
    lines: bool = True
    diagonal: bool = False


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str,
               series: dict[str, tuple[list[float], list[float]]], hline: float | None = None,
               hline_label: str = "", logy: bool = False) -> None:
    plot_panels(path, "", [Panel(title, xlabel, ylabel, series, hline, hline_label, logy)])


def plot_panels(path: Path, title: str, panels: list[Panel]) -> None:
    """Panels side by side. A series keeps its colour in every panel (tab20 beyond 10 series);
    several panels share one legend below them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(name for panel in panels for name in panel.series))
    palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20").colors
    colors = {name: palette[i % len(palette)] for i, name in enumerate(names)}
    shared = len(panels) > 1
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        _draw(ax, panel, colors)
        if not shared:
            ax.legend(fontsize="small")
    if shared:
        handles = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)),
                   fontsize="small", frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06 * -(-len(names) // 4) if shared else 0, 1, 1))
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


def _draw(ax, panel: Panel, colors: dict) -> None:
    style = {"marker": "o", "markersize": 3} if panel.lines else {"marker": "o", "linestyle": ""}
    for name, (xs, ys) in panel.series.items():
        ax.plot(xs, ys, label=name, color=colors[name], **style)
    if panel.hline is not None:
        ax.axhline(panel.hline, linestyle="--", color="gray", label=panel.hline_label)
    if panel.diagonal:
        values = [v for xs, ys in panel.series.values() for v in (*xs, *ys) if v > 0 or not panel.logy]
        if values:
            ax.plot([min(values), max(values)], [min(values), max(values)], linestyle=":", color="gray",
                    label="y = x")
    if panel.logy:
        ax.set_yscale("log")
        if panel.diagonal:
            ax.set_xscale("log")
    ax.set_title(panel.title)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
