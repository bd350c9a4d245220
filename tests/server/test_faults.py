"""Faults, on a real engine served in-process: an exception inside one engine step (the engine's
fault hook) fails only that step's requests; a fatal one kills the loop, and then /health and
every request get 503 at once; --request-timeout aborts and frees."""
import concurrent.futures as cf
import json
import threading
import time

import httpx
import pytest

from pdserve.engine.llm_engine import LLMEngine
from tests.server.conftest import metrics, wait_for
from tests.server.inprocess import serve, wait_idle

LONG = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
SHORT = {"prompt": "The sea", "max_tokens": 6, "ignore_eos": True, "temperature": 0}


class Crash(BaseException):
    """Not an Exception: what a fatal error inside the engine looks like to the loop."""


class Hook:
    """The engine's fault hook: slows every step a little (so a test can act between steps),
    and raises `error` in the first step after arm()."""

    def __init__(self, error: BaseException, delay: float = 0.005):
        self.error, self.delay = error, delay
        self._armed = threading.Event()
        self.fired = 0

    def arm(self):
        self._armed.set()

    def __call__(self, sched):
        time.sleep(self.delay)
        if self._armed.is_set():
            self._armed.clear()
            self.fired += 1
            raise self.error


@pytest.fixture
def engine(tiny_llama):
    return LLMEngine(tiny_llama, max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=128, block_size=16)


def stream(url: str, body: dict, started: threading.Event) -> list:
    """The data events of a streamed completion (parsed JSON, and "[DONE]")."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()
    return events


def start_streams(pool, url, n: int):
    started = [threading.Event() for _ in range(n)]
    futures = [pool.submit(stream, url, LONG, e) for e in started]
    for e in started:
        assert e.wait(30)
    return futures


def ends_with_error(events: list, code: str) -> dict:
    """The stream ended with an error event, then [DONE]; before it only token chunks."""
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == code and error["type"] == "server_error" and error["message"]
    assert all("choices" in e and e["choices"][0]["finish_reason"] is None for e in events[:-2])
    return error


def test_a_failing_step_fails_only_its_requests(engine):
    engine.fault_hook = hook = Hook(RuntimeError("injected fault"))
    with serve(engine) as url, cf.ThreadPoolExecutor(4) as pool:
        a, b = start_streams(pool, url, 2)      # both seats (--max-num-seqs 2)
        c = pool.submit(httpx.post, url + "/v1/completions", json=SHORT, timeout=60)
        wait_for(url, lambda m: m["pdserve:num_requests_waiting"] == 1)   # c waits: not in the next step
        hook.arm()
        for f in (a, b):
            assert "failed" in ends_with_error(f.result(), "engine_error")["message"]
        r = c.result()
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 6
        # a non-streamed request in a failing step gets a 500 in the error format
        hook.arm()
        r = httpx.post(url + "/v1/completions", json=SHORT, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert hook.fired == 2
        # and the engine goes on serving, with every block back
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/v1/completions", json=SHORT, timeout=60).status_code == 200
        m = wait_idle(url)
        assert m['pdserve:request_success_total{finished_reason="error"}'] == 3
        assert m['pdserve:request_success_total{finished_reason="length"}'] == 2
        engine.block_manager.check_all_free()
        assert not engine.seqs


def test_a_dead_engine_loop_gives_503_at_once(engine):
    engine.fault_hook = hook = Hook(Crash())
    with serve(engine) as url, cf.ThreadPoolExecutor(4) as pool:
        (a,) = start_streams(pool, url, 1)
        b = pool.submit(httpx.post, url + "/v1/completions", json=LONG, timeout=60)
        wait_for(url, lambda m: m["pdserve:num_requests_running"] == 2)
        hook.arm()
        ends_with_error(a.result(), "engine_dead")
        r = b.result()
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and "Crash" in health.json()["error"]["message"]
        for path, body in [("/v1/completions", SHORT), ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                              "content": "Hi"}]}),
                           ("/generate_stream", {"prompt": "Hi"})]:
            r = httpx.post(url + path, json=body, timeout=5)   # a hang fails here
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", (path, r.text)


def test_request_timeout_aborts_and_frees(engine):
    engine.fault_hook = Hook(RuntimeError("never armed"), delay=0.01)   # 500 tokens take > 5 s
    with serve(engine, request_timeout=1.0) as url, cf.ThreadPoolExecutor(4) as pool:
        t0 = time.monotonic()
        a = pool.submit(stream, url, LONG, threading.Event())
        b = pool.submit(httpx.post, url + "/v1/completions", json=LONG, timeout=60)
        c = pool.submit(httpx.post, url + "/v1/completions", json=LONG, timeout=60)   # waits, never runs
        error = ends_with_error(a.result(), "request_timeout")
        assert "--request-timeout (1 s)" in error["message"]
        for f in (b, c):
            r = f.result()
            assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
        assert 1.0 <= time.monotonic() - t0 < 30
        m = wait_idle(url)
        assert m['pdserve:request_success_total{finished_reason="abort"}'] == 3
        engine.block_manager.check_all_free()
        # a request that finishes in time is untouched
        r = httpx.post(url + "/v1/completions", json=SHORT, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        assert metrics(url)['pdserve:request_success_total{finished_reason="abort"}'] == 3
