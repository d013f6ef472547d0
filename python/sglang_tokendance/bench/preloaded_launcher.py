"""A process that imports SGLang's server once and forks every server from it.

A server start pays SGLang's import in its main process (about 20 s of CPU on a 2-core machine,
a third of a start); a forked server starts with it done. The server itself is unchanged: the
fork runs `python -m <module> <argv>` as `runpy` does, with its own environment, session and
log. Nothing here runs before the fork but imports, so no plugin, hook or thread of a server is
shared. On the CPU the server also forks its scheduler and detokenizer instead of spawning
fresh interpreters (`fork_subprocesses`): they start with its imports done too.

The launcher detaches from whoever starts it (it is not that process's descendant), because
SGLang's `Engine.shutdown` kills every descendant of the process it runs in; it ends, killing
its servers, when the starting process closes its pipe or dies.

Protocol: one JSON object per line on stdin, one answer per line on stdout:
  {"start": module, "argv": [...], "env": {...}, "log": path, "fork_subprocesses": bool} -> {"pid": pid}
  {"wait": pid, "block": bool}                                -> {"returncode": int | null}
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

# the server's main process, and what its forked scheduler imports next (the model registry imports
# every model module SGLang ships: about 3 s of a tiny model's 13 s start)
PRELOADED_MODULES = ("sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang_tokendance.launch_server",
                     "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager",
                     "sglang.srt.model_executor.model_runner", "sglang.srt.models.registry")


class PreloadedLauncher:
    """The client side: starts the launcher process and asks it to fork, poll and reap servers."""

    def __init__(self) -> None:
        from sglang_tokendance import cpu

        cpu.prepare_process()  # the CPU route's environment, before the launcher's imports
        self._lock = threading.Lock()
        intermediate = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._stdin, self._stdout = intermediate.stdin, intermediate.stdout
        intermediate.wait()  # it forks the launcher and exits at once
        if self._read() != {"ready": True}:
            raise RuntimeError("the preloaded launcher did not start")

    def _read(self) -> dict[str, Any]:
        line = self._stdout.readline()
        if not line:
            raise RuntimeError("the preloaded launcher exited")
        return json.loads(line)

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._stdin.write(json.dumps(request) + "\n")
            self._stdin.flush()
            return self._read()

    def start(self, module: str, argv: list[str], env: dict[str, str], log_path: Path,
              fork_subprocesses: bool = False) -> "ForkedServer":
        """`python -m module *argv` with exactly `env`, stdout and stderr to `log_path`; on the CPU
        with `fork_subprocesses`, SGLang's subprocesses forked from it (`fork_subprocesses()`)."""
        pid = self._ask({"start": module, "argv": argv, "env": env, "log": str(log_path),
                         "fork_subprocesses": fork_subprocesses})["pid"]
        return ForkedServer(self, pid)

    def close(self) -> None:
        """Ends the launcher; it kills the servers it still has."""
        self._stdin.close()
        self._stdout.close()


class ForkedServer:
    """A server forked by the launcher: the part of `subprocess.Popen` that ServerProcess uses."""

    def __init__(self, launcher: PreloadedLauncher, pid: int) -> None:
        self._launcher, self.pid, self.returncode = launcher, pid, None

    def _wait(self, block: bool) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher._ask({"wait": self.pid, "block": block})["returncode"]
        return self.returncode

    def poll(self) -> int | None:
        return self._wait(block=False)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            return self._wait(block=True)
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout)
            time.sleep(0.2)
        return self.returncode


def fork_subprocesses() -> None:
    """In a CPU server: SGLang sets the start method "spawn" (a fresh interpreter per scheduler
    and detokenizer, which re-imports SGLang and torch: about 20 s of a 2-core machine per
    server); take "fork" instead, so they inherit the server's imports. Spawn exists for CUDA,
    which a forked child cannot use; these servers have no GPU, and the server's process forks
    them before it starts any thread of its own (SGLang launches its subprocesses first). Only
    for a server started without SGLang settings of its own (`server_process.may_fork`): the
    modules it inherits read theirs when the launcher imported them."""
    import multiprocessing

    set_start_method = multiprocessing.set_start_method

    def fork_instead_of_spawn(method: str | None, force: bool = False) -> None:
        set_start_method("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = fork_instead_of_spawn


def _run_forked(request: dict[str, Any], protocol: list[IO]) -> None:
    """In the fork: become the server (own session, environment, argv and log) and never return."""
    code = 1
    try:
        os.setsid()
        for stream in protocol:
            stream.close()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # as at start-up
        sys.argv = [request["start"], *request["argv"]]
        sys.modules.pop(request["start"], None)  # runpy runs a fresh copy as __main__ either way
        if request.get("fork_subprocesses") and os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":  # on the CPU
            fork_subprocesses()
        try:
            runpy.run_module(request["start"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:  # as the interpreter does: sys.exit("message") prints it, exits 1
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, block: bool) -> int | None:
    done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None


def _serve() -> None:
    """The launcher: detach, import, then fork a server per request until stdin closes."""
    if os.fork():
        os._exit(0)  # the starter's child ends; the launcher is nobody's descendant but init's
    os.setsid()
    requests_in = sys.stdin
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever an import prints must not reach the protocol
    from sglang_tokendance import cpu

    cpu.prepare_process()
    for name in PRELOADED_MODULES:
        __import__(name)
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    servers: set[int] = set()
    for line in requests_in:
        request = json.loads(line)
        if "start" in request:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_forked(request, [requests_in, answers])
            servers.add(pid)
            answer: dict[str, Any] = {"pid": pid}
        else:
            answer = {"returncode": _wait(request["wait"], request["block"])}
            if answer["returncode"] is not None:
                servers.discard(request["wait"])
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    for pid in servers:  # the starter is gone: so are its servers
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait(pid, block=True)


if __name__ == "__main__":
    _serve()
