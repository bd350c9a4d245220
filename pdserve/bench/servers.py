"""Server processes for benchmarks/compare.py: start one on 127.0.0.1 in its own process group,
wait for /health, stop the whole group by its id; one streamed completion request sent the
way `pdserve bench` sends it, to check that a server answers; and pdserve's /metrics as numbers
(also used by the end-to-end tests, tests/server/conftest.py)."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field


class PeerError(Exception):
    """A server (or a peer's install) failed. The message names the step and ends with the last
    lines of that step's log."""


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


def scrape_metrics(base_url: str) -> dict[str, float]:
    """The /metrics samples as {'name{labels}': value}, without the model_name label every
    pdserve series carries (one server serves one model): 'pdserve:num_requests_running'."""
    samples = {}
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                name = re.sub(r'(?<=\{)model_name="[^"]*",?|,model_name="[^"]*"', "", name).replace("{}", "")
                samples[name] = float(value)
    return samples


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A server process started in its own process group, listening on 127.0.0.1:port."""
    name: str
    cmd: list[str]
    port: int
    log_path: str
    env: dict | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)
    ready_s: float | None = None  # seconds from start to a healthy /health

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> "Server":
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        log = open(self.log_path, "w", encoding="utf-8")
        log.write(f"$ {' '.join(self.cmd)}\n")
        log.flush()
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        except OSError as e:
            raise PeerError(f"start {self.name}: {e}") from None
        finally:
            log.close()
        try:
            wait_healthy(self, timeout)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `timeout` seconds."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                # the leader is gone; give its children a moment, then make sure of them too
                time.sleep(0.5)
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_healthy(server: Server, timeout: float) -> None:
    """Poll GET /health until 200; PeerError if the process exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        rc = server.proc.poll()
        if rc is not None:
            raise PeerError(f"start {server.name}: exited with status {rc} before it was healthy "
                            f"(log: {server.log_path})\n{log_tail(server.log_path)}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
            if status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        if time.monotonic() > deadline:
            raise PeerError(f"start {server.name}: not healthy after {timeout:.0f} s "
                            f"(log: {server.log_path})\n{log_tail(server.log_path)}")
        time.sleep(1.0)


def check_completion(base_url: str, model: str | None, prompt: list[int], max_tokens: int = 8,
                     timeout: float = 300.0) -> dict:
    """One streamed /v1/completions request as `pdserve bench` sends it (token-id prompt,
    ignore_eos, stream_options.include_usage). Returns what came back: the number of text
    events, the usage, the time to the first event and in total; PeerError if it is malformed."""
    url = urllib.parse.urlparse(base_url)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise PeerError(f"POST /v1/completions: HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
    events, usage, first, done, finish = 0, None, None, False, None
    for raw in resp:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            events += 1
            if first is None:
                first = time.monotonic() - t0
            finish = choice.get("finish_reason") or finish
    conn.close()
    result = {"text_events": events, "usage": usage, "finish_reason": finish, "first_event_s": first,
              "total_s": time.monotonic() - t0, "done": done}
    if not done or usage is None or usage.get("completion_tokens") != max_tokens:
        raise PeerError(f"streamed completion malformed or short: {result}")
    return result
