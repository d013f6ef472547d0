"""Start, await and stop an HTTP server, ours or stock SGLang, as a child process.

Used by the tests and the benchmarks that compare TokenDance with stock SGLang. A stock server
gets the same model and CPU defaults as ours (and the sgl_kernel fallback, when needed) but
no TokenDance options in its environment, so our installed plugin stays inert in it.
"""

from __future__ import annotations

import os
import signal
from abc import ABC, abstractmethod
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import requests

from sglang_tokendance import cpu
from sglang_tokendance.launch_server import with_defaults
from sglang_tokendance.bench.preloaded_launcher import PreloadedLauncher
from sglang_tokendance.server_args import ENV_VAR

_preloading = False
_launcher: PreloadedLauncher | None = None


@contextmanager
def preloaded() -> Iterator[None]:
    """Within it, every ServerProcess is forked from one process that imported SGLang once (a
    third of a server start saved; started with the first server) and that is not this
    process's descendant, so an in-process `sglang.Engine`'s shutdown, which kills every
    descendant of its process, spares them."""
    global _preloading, _launcher
    _preloading = True
    try:
        yield
    finally:
        if _launcher is not None:
            _launcher.close()
        _preloading, _launcher = False, None


def preloaded_launcher() -> PreloadedLauncher:
    """The launcher of the enclosing `preloaded()` block, started on first use."""
    global _launcher
    if not _preloading:
        raise RuntimeError("preloaded_launcher() outside a preloaded() block")
    if _launcher is None:
        _launcher = PreloadedLauncher()
    return _launcher


# SGLang settings read where they are used (`envs.X.get()` in a function), never at import: a
# forked server sees them as a fresh process would (SGLang 0.5.23's scheduler checks this one per step)
READ_WHEN_USED = frozenset({"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"})


def may_fork(extra_env: dict[str, str]) -> bool:
    """Whether a preloaded server may fork SGLang's subprocesses (bench/preloaded_launcher): not
    when its caller sets SGLang settings of its own (`SGLANG_*` but ours and READ_WHEN_USED),
    which some SGLang modules read when imported, and the launcher imported them without."""
    return not any(k.startswith("SGLANG") and not k.startswith("SGLANG_TOKENDANCE_") and k not in READ_WHEN_USED
                   for k in extra_env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_ATTEMPTS = 3  # ports a server we place tries: another process may bind the one free_port() chose first


class PortTaken(RuntimeError):
    """The child could not bind its port: something bound it after `free_port()` chose it."""


def flush_cache(url: str) -> None:
    """Empty the server's caches once its last request has ended (SGLang's /flush_cache refuses
    while requests run; its `timeout` waits for them)."""
    requests.post(url + "/flush_cache", params={"timeout": 120}, timeout=180).raise_for_status()


class ChildService(ABC):
    """An HTTP service run as a child in its own process group, logging to a file; `stop()` ends
    the whole group. Subclasses say when it is ready to serve (`ready`)."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    kind = "server"

    @abstractmethod
    def ready(self) -> bool:
        """Whether it serves now (a connection error counts as not yet)."""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = 600.0):
        """Block until `ready()`, or raise with the end of the child's log (`PortTaken` at once
        when it could not bind its port: SGLang's server then stays up without serving)."""
        deadline = time.monotonic() + timeout
        taken = f"', {self.url.rsplit(':', 1)[1]}): address already in use"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if taken in self.log_tail():
                self.stop()
                raise PortTaken(f"{self.kind} could not bind {self.url}:\n{self.log_tail()}")
            try:
                if self.ready():
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.kind} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """End the child and every process it spawned (they share its process group) at once.
        SGLang's SIGTERM drains and then, when its scheduler got the signal too, sleeps 5 s
        for crash diagnostics; a server this class started holds nothing that needs either."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess(ChildService):
    """A server child (ours or stock SGLang); ready when /health answers 200."""

    def __init__(self, argv: list[str], *, stock: bool = False, port: int | None = None,
                 env: dict[str, str] | None = None, log_path: str | Path | None = None):
        self.placed = port is None  # we chose the port: another may be tried (`wait_ready`)
        on_cpu = cpu.prepare_process()  # puts the CPU route into os.environ, inherited below
        self._env, self._may_fork = {**os.environ, **(env or {})}, may_fork(env or {})
        if stock:
            self._env.pop(ENV_VAR, None)
            self._module, self._argv = "sglang.launch_server", with_defaults(argv, on_cpu)
        else:
            self._module, self._argv = "sglang_tokendance.launch_server", argv
        self._log_path = log_path
        self._start(port or free_port())

    def _start(self, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        if self._log_path is None:
            self._log = tempfile.NamedTemporaryFile(prefix="tokendance-server-", suffix=".log", delete=False)
        else:
            self._log = open(self._log_path, "wb")
        self.log_path = Path(self._log.name)
        argv = [*self._argv, "--host", "127.0.0.1", "--port", str(port)]
        if _preloading:
            self.proc = preloaded_launcher().start(self._module, argv, self._env, self.log_path, self._may_fork)
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", self._module, *argv], env=self._env,
                                         stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 600.0):
        """As a child service; a server on a port we chose that another process bound first
        starts again on another port (up to PORT_ATTEMPTS ports)."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return super().wait_ready(timeout)
            except PortTaken:
                if not self.placed or attempt == PORT_ATTEMPTS:
                    raise
                self._start(free_port())

    def ready(self) -> bool:
        return requests.get(self.url + "/health", timeout=5).status_code == 200
