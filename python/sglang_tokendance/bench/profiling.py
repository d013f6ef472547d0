"""Where a server's prefill time goes: py-spy samples of the scheduler process, sorted into
operations (attention, MLP, ...) and blended-prefill phases (probe, selection, ...).

py-spy records raw collapsed stacks ("outer;...;inner count", each frame "func (file:line)")
without idle samples, so only the scheduler's busy time counts. A sample belongs to the
first category, in the order listed, that any of its frames matches.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# (category, regex on a frame's function name), by priority
OPERATIONS = [
    ("segment restore copy (before the forward)", r"^restore$"),
    ("attention mass (before: its own second pass; after: from the pass's log-sum-exp)",
     r"^attention_received$|^attention_mass$"),
    ("selection scoring + top-r", r"^select_kept$|^_attention_kv$|deviation$|^<lambda>$"),
    ("write-back (before: cached KV restored; after: kept tokens' probe KV written)",
     r"^_restore_cached$|^_drop_tracked$|^_write_probe_kv$"),
    ("attention", r"position_masked_attention|_run_sdpa_forward_extend|^attend$|^_sdpa$|^_mass_attention$"),
    ("MLP", r"MLP\.forward$"),
    ("norms", r"RMSNorm"),  # before QKV: the blended path's qkv runs the input norm
    ("QKV projection + RoPE", r"forward_prepare_native|SGLangLayers\.qkv|RotaryEmbedding"),
    ("o_proj", r"RowParallelLinear"),
    ("KV pool write / gather", r"set_kv_buffer|PoolKV\.|gather_kv"),
    ("logits + sampling", r"LogitsProcessor|Sampler|sample"),
    ("other in the forward (Python / host)", r"blended_prefill|^model_forward$|Model\.forward$"),
]
PHASES = [
    ("segment restore copy (before the forward)", r"^restore$"),
    ("selection (screen + check)", r"^select_kept$|^select$|^_attention_kv$|deviation$|^_screen_out$"),
    ("write-back (as above)", r"^_restore_cached$|^_drop_tracked$|^_write_probe_kv$"),
    ("probe layers 0..c (screen included)", r"^_probe_layers$"),
    ("layers after the check (or all, plain reuse)", r"^_run_layers$"),
    ("other blended-prefill work", r"blended_prefill|^probe$|^finish$"),
    ("SGLang's own forward", r"Model\.forward$"),
]
REST = "scheduler, batching, HTTP (outside the forward)"


def _function(frame: str) -> str:
    return frame.rsplit(" (", 1)[0]


def categorize(collapsed: str, rules: list[tuple[str, str]]) -> Counter:
    """Samples per category of `rules` (REST when no frame matches) from py-spy raw output."""
    compiled = [(name, re.compile(pattern)) for name, pattern in rules]
    counts: Counter = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        functions = [_function(f) for f in stack.split(";")]
        name = next((name for name, rx in compiled if any(rx.search(f) for f in functions)), REST)
        counts[name] += int(count)
    return counts


def breakdown_table(counts: Counter, rules: list[tuple[str, str]], rate: int) -> str:
    """Markdown: seconds (samples / rate) and share of busy time per category, in rule order."""
    total = sum(counts.values()) or 1
    lines = ["| category | seconds | share |", "|---|---|---|"]
    for name in [n for n, _ in rules] + [REST]:
        if counts[name]:
            lines.append(f"| {name} | {counts[name] / rate:.2f} | {counts[name] / total:.1%} |")
    lines.append(f"| **total busy** | {total / rate:.2f} | 100% |")
    return "\n".join(lines)


def scheduler_pid(server_pid: int) -> int:
    """The SGLang scheduler process among the server's descendants."""
    import psutil

    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
                return child.pid
        except psutil.Error:
            continue
    raise RuntimeError(f"no SGLang scheduler process under pid {server_pid}")


class PySpy:
    """Records the scheduler's stacks around chosen stretches of time, appending to one file."""

    def __init__(self, pid: int, output: Path, rate: int):
        self.pid, self.output, self.rate = pid, output, rate
        self.output.write_text("")
        self.exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))

    @contextmanager
    def recording(self) -> Iterator[None]:
        part = self.output.with_suffix(".part")
        proc = subprocess.Popen([self.exe, "record", "--pid", str(self.pid), "--rate", str(self.rate),
                                 "--format", "raw", "--nonblocking", "--output", str(part)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached before the work starts
        try:
            yield
        finally:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
            if not part.exists():
                raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-2000:]}")
            with open(self.output, "a") as out:
                out.write(part.read_text())
            part.unlink()
