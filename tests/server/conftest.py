"""Real `python -m pdserve serve` processes on free loopback ports, for the end-to-end tests.

Server output goes to a log file (a pipe nobody reads would fill and stall the server);
a failing start shows the log's tail.
"""
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.bench.servers import free_port, scrape_metrics as metrics  # re-exported to the tests


def wait_for(url: str, predicate, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until predicate(samples) holds; returns the samples (fails the test otherwise)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if predicate(m):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"metrics condition not met within {timeout}s: "
                        f"{ {k: v for k, v in m.items() if not re.search('_bucket|_created', k)} }")
        time.sleep(0.02)


class Server:
    def __init__(self, model: str | None, *args: str, log_dir: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"server-{self.port}.log")
        self._log = open(self.log_path, "w")
        model_args = [] if model is None else ["--model", model]   # None: the bundled default model (or in args)
        cmd = [sys.executable, "-m", "pdserve", "serve", *model_args, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._wait_ready()

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()[-3000:]}")

    def metrics(self) -> dict[str, float]:
        return metrics(self.url)

    def wait_for(self, predicate, timeout: float = 10.0) -> dict[str, float]:
        return wait_for(self.url, predicate, timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(model or None, *flags) -> a running Server; all are stopped at the end of the session."""
    servers = []
    log_dir = str(tmp_path_factory.mktemp("server-logs"))

    def start(model: str, *args: str, env: dict | None = None) -> Server:
        servers.append(Server(model, *args, log_dir=log_dir, env=env))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def server(start_server, tiny_llama, tmp_path_factory):
    """The shared server most tests talk to: the tiny llama checkpoint with default limits,
    writing its step log to `server.step_log`."""
    step_log = str(tmp_path_factory.mktemp("steps") / "steps.jsonl")
    s = start_server(tiny_llama, "--step-log", step_log)
    s.step_log = step_log
    return s
