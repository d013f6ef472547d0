"""bench_round_hold: the cost of holding an inferred round, its CLI and summary."""

from __future__ import annotations

import pytest

from sglang_tokendance import bench_round_hold


def test_cli_refuses_bad_windows_gaps_and_rounds_of_one():
    for argv in (["--windows", "50,x"], ["--windows", "0"], ["--gaps-ms", "-5"], ["--num-agents", "1"],
                 ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench_round_hold.parse_args(argv)
    assert list(bench_round_hold.settings([10, 50])) == ["stock", "no-hold", "window-10", "window-50"]


def test_summary_is_the_median_over_repeats_against_stock_at_the_same_gap():
    def row(setting, gap, ttft, makespan, reused=0):
        return {"setting": setting, "gap_ms": gap, "mean_ttft_s": ttft, "makespan_s": makespan,
                "reused_tokens": reused}

    rows = [row("stock", 0, 1.0, 4.0), row("stock", 0, 3.0, 6.0), row("stock", 0, 2.0, 5.0),
            row("window-50", 0, 1.0, 2.0, 10), row("window-50", 0, 9.0, 3.0, 30), row("window-50", 0, 1.5, 2.5, 20),
            row("window-50", 25, 1.0, 1.0, 5)]
    summary = {(s["setting"], s["gap_ms"]): s for s in bench_round_hold.summarise(rows)}
    held = summary["window-50", 0]
    assert (held["mean_ttft_s"], held["makespan_s"], held["reused_tokens"], held["repeats"]) == (1.5, 2.5, 20, 3)
    assert held["mean_ttft_s_vs_stock"] == pytest.approx(0.75) and held["makespan_s_vs_stock"] == pytest.approx(0.5)
    assert held["makespan_spread_s"] == "2.00-3.00"
    assert "makespan_s_vs_stock" not in summary["window-50", 25]  # no stock round at that gap
