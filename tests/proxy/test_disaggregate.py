"""`pdserve serve --disaggregate` as a user runs it: two pinned workers and the proxy start, serve,
and stop together, leaving no process behind, whether it is stopped, a worker dies mid-stream, or
the launcher itself is killed."""
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pdserve.bench.servers import free_port, scrape_metrics as metrics

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
LINE = re.compile(r"^(prefill|decode) worker: (\S+) \(cores (\S+), \d+ threads?, pid (\d+)\)$", re.M)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout: float = 180.0) -> None:   # a graceful stop is slow on a busy machine
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)


class Launched:
    def __init__(self, model: str, tmp_path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out, self.err = tmp_path / "stdout.log", tmp_path / "stderr.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model", model, "--disaggregate",
                                      "--port", str(self.port), "--log-level", "warning", *flags],
                                     stdout=open(self.out, "w"), stderr=open(self.err, "w"))
        deadline = time.monotonic() + 180
        while "proxy: " not in self.out.read_text():
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, self.err.read_text()[-3000:]
            time.sleep(0.2)
        self.workers = {m[0]: {"url": m[1], "cores": m[2], "pid": int(m[3])} for m in LINE.findall(self.out.read_text())}
        self.pids = [w["pid"] for w in self.workers.values()]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pid in self.pids:   # (a test that failed half-way)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launch(tiny_llama, tmp_path):
    started = []

    def start(*flags):
        started.append(Launched(tiny_llama, tmp_path, *flags))
        return started[-1]
    yield start
    for s in started:
        s.close()


def test_it_serves_on_pinned_workers_and_stops_them_all_on_sigterm(launch):
    s = launch()
    assert set(s.workers) == {"prefill", "decode"}
    assert os.sched_getaffinity(s.workers["prefill"]["pid"]) == {sorted(os.sched_getaffinity(0))[0]}
    assert os.sched_getaffinity(s.workers["decode"]["pid"]) == {sorted(os.sched_getaffinity(0))[1]}
    with open(f"/proc/{s.workers['decode']['pid']}/cmdline") as f:
        decode_cmd = f.read()
    assert "--threads\x001\x00" in decode_cmd and "--kv-transfer-peers\x00127.0.0.1:" in decode_cmd
    # the KV channel's secret: generated, in the workers' environment, on no command line
    with open(f"/proc/{s.workers['prefill']['pid']}/environ") as f:
        secret = dict(v.split("=", 1) for v in f.read().split("\x00") if "=" in v)["PDSERVE_KV_TRANSFER_SECRET"]
    with open(f"/proc/{s.workers['prefill']['pid']}/cmdline") as f:
        assert len(secret) == 64 and secret not in f.read() + decode_cmd
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = c.completions.create(model=c.models.list().data[0].id, prompt="Once upon a time", max_tokens=5,
                             temperature=0)
    assert r.usage.completion_tokens == 5
    assert metrics(s.workers["decode"]["url"])["pdserve:kv_transfers_total"] == 1   # pulled on the channel
    assert httpx.get(s.url + "/health").json()["status"] == "ok"
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(90) == 0
    wait_gone(s.pids)


def test_a_decode_worker_killed_mid_stream_ends_it_with_an_error_and_stops_the_rest(launch):
    s = launch()
    # 16 choices x 1000 tokens with logprobs: megabytes of events, far more than the sockets
    # buffer, so the stream is still under way when its worker dies
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "n": 16, "logprobs": 5, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        os.kill(s.workers["decode"]["pid"], signal.SIGKILL)
        events = [line for line in lines if line.startswith("data: ")]
    assert '"code": "worker_failed"' in events[-2] and "decode worker" in events[-2]
    assert events[-1] == "data: [DONE]"
    assert s.proc.wait(90) == 1   # the launcher stopped the prefill worker and the proxy
    assert "the decode worker exited" in s.err.read_text()
    wait_gone(s.pids)


def test_killing_the_launcher_takes_its_workers_with_it(launch):
    s = launch()
    s.proc.kill()
    s.proc.wait()
    wait_gone(s.pids)
