"""SGLang's router (`sglang-router`) in front of workers, as a child process.

Used by the tests and `bench_multiagent --workers`. The router is a Rust binary behind a
Python launcher; it listens before its workers are registered (a request then gets a 503), so
`wait_ready` waits until `/readiness` counts every worker healthy.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import requests

from sglang_tokendance.bench.server_process import ChildService, free_port

# `python -m sglang_router.launch_router` less its import of the debug load balancer (mini_lb),
# which imports SGLang: 15 s of a start on these CPUs where SGLang is installed. Same arguments.
LAUNCH = ("import argparse, sys, setproctitle\n"
          "from sglang_router.router import Router\n"
          "from sglang_router.router_args import RouterArgs\n"
          "parser = argparse.ArgumentParser()\n"
          "RouterArgs.add_cli_args(parser, use_router_prefix=False)\n"
          "args = RouterArgs.from_cli_args(parser.parse_args(sys.argv[1:]), use_router_prefix=False)\n"
          "args._validate_router_args()\n"
          "setproctitle.setproctitle('sglang::router')\n"
          "Router.from_args(args).start()\n")
# A lost worker costs no failed request: its circuit opens on the first failure, so the retry
# goes to another worker, and the health check notices within a second (the defaults answer
# two requests per routing key with a 500 first, and check health once a minute).
FAST_FAILOVER = ("--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "5",
                 "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                 "--health-success-threshold", "1")
# A new routing key goes to the worker with the fewest active keys (the default, random, put all
# four simulations of a benchmark run on one of two workers); ties, as with sequential
# traffic, are still broken at random.
MANUAL_ASSIGNMENT = ("--assignment-mode", "min_group")


class RouterProcess(ChildService):
    """SGLang's router over `worker_urls` with `policy`, in its own process group; `stop()` ends it."""

    def __init__(self, worker_urls: list[str], policy: str = "manual", extra_args: tuple[str, ...] = FAST_FAILOVER):
        self.kind, self.port, self.workers = "router", free_port(), len(worker_urls)
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="tokendance-router-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        argv = ["--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                # its Prometheus listener defaults to 0.0.0.0:29000, one per machine
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--worker-urls", *worker_urls, *(MANUAL_ASSIGNMENT if policy == "manual" else ()), *extra_args]
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH, *argv],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def ready(self) -> bool:
        """Every worker counted healthy (the router answers before it has registered them)."""
        ready = requests.get(self.url + "/readiness", timeout=5)
        return ready.status_code == 200 and ready.json().get("healthy_workers") == self.workers
