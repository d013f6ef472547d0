"""The preloaded launcher forks servers that behave as `python -m module argv` started alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from sglang_tokendance.bench.server_process import may_fork, preloaded_launcher

pytestmark = pytest.mark.slow  # a launcher imports SGLang's server once (~20 s on 2 cores)

PRINTS_ITS_WORLD = "import os, sys; print(sys.argv[1:], os.environ.get('PROBE'), os.getpgid(0) == os.getpid())"


@pytest.fixture
def launcher(preloaded_servers):
    return preloaded_launcher()  # the session's (conftest)


def gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


def test_a_forked_module_gets_its_argv_environment_session_and_log(launcher, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PRINTS_ITS_WORLD + "\nraise SystemExit(3)\n")
    log = tmp_path / "probe.log"
    server = launcher.start("probe", ["--flag", "x"], {"PROBE": "yes", "PYTHONPATH": str(tmp_path)}, log)
    assert server.wait(timeout=60) == 3
    assert log.read_text().split() == ["['--flag',", "'x']", "yes", "True"]


def test_a_cpu_server_forks_sglangs_subprocesses_only_when_it_sets_no_sglang_settings(launcher, tmp_path):
    """SGLang asks for "spawn"; a server forked for a caller that sets no SGLang settings gets
    "fork" (its scheduler inherits the imports); one whose caller sets some keeps "spawn": SGLang
    reads some of them when a module is imported (e.g. the scheduler's SGLANG_TEST_RETRACT), unless
    it sets only settings read where they are used."""
    (tmp_path / "start_method.py").write_text(
        "import multiprocessing\nmultiprocessing.set_start_method('spawn', force=True)\n"
        "print(multiprocessing.get_start_method())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    methods = []
    for extra in ({"SGLANG_TOKENDANCE_CONFIG": "{}"}, {"SGLANG_TEST_RETRACT": "1"},
                  {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"}):  # the last read where used
        log = tmp_path / "method.log"
        assert launcher.start("start_method", [], {**env, **extra}, log, may_fork(extra)).wait(timeout=60) == 0
        methods.append(log.read_text().strip())
    assert methods == ["fork", "spawn", "fork"]


def test_our_launchers_refusal_is_its_exit_status_and_message(launcher, tmp_path):
    log = tmp_path / "refused.log"
    server = launcher.start("sglang_tokendance.launch_server", ["--tokendance-nope", "1"], dict(os.environ), log)
    assert server.wait(timeout=60) == 2
    assert "unrecognized TokenDance option: --tokendance-nope" in log.read_text()


def test_servers_are_not_descendants_of_the_starter(launcher, tmp_path):
    """SGLang's Engine.shutdown kills every descendant of its process: a server must not be one."""
    server = launcher.start("http.server", ["--bind", "127.0.0.1", "0"], dict(os.environ), tmp_path / "http.log")
    assert server.poll() is None
    descendants = {p.pid for p in psutil.Process().children(recursive=True)}
    assert server.pid not in descendants
    assert psutil.Process(server.pid).ppid() not in descendants | {os.getpid()}
    deadline = time.monotonic() + 60
    while os.getpgid(server.pid) != server.pid and time.monotonic() < deadline:  # its setsid() may not have run yet
        time.sleep(0.05)
    os.killpg(server.pid, 9)
    assert server.wait(timeout=60) == -9


def test_a_starter_gone_without_closing_takes_the_launcher_and_its_servers(tmp_path):
    starter = subprocess.run(
        [sys.executable, "-c",
         "import os, sys\n"
         "from sglang_tokendance.bench.preloaded_launcher import PreloadedLauncher\n"
         "server = PreloadedLauncher().start('http.server', ['--bind', '127.0.0.1', '0'], dict(os.environ), "
         f"{str(tmp_path / 'http.log')!r})\n"
         "print(server.pid, flush=True)\n"
         "os._exit(0)\n"],  # no close(): as if killed
        capture_output=True, text=True, timeout=300, check=True)
    assert gone(int(starter.stdout.split()[-1]))
