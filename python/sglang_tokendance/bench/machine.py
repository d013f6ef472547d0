"""Is the machine idle enough to time anything? These machines are shared, and another
process can slow a 2-thread run 5-25x, so every benchmark checks before it measures."""

from __future__ import annotations

import time


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_busy_fraction(seconds: float = 2.0) -> float:
    """Share of all cores busy over `seconds` (0..1), from /proc/stat."""
    busy0, total0 = _cpu_times()
    time.sleep(seconds)
    busy1, total1 = _cpu_times()
    return (busy1 - busy0) / max(1, total1 - total0)


def idle_check(threshold: float = 0.15, seconds: float = 2.0) -> dict:
    busy = cpu_busy_fraction(seconds)
    return {"cpu_busy_fraction": round(busy, 3), "threshold": threshold, "idle": busy <= threshold}
