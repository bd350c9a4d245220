"""The server builds its engine and steps it on one thread (async_engine.EngineThread says why:
two OpenMP pools on two cores put the workers to sleep between parallel regions)."""
import argparse
import threading

import pytest
from fastapi.testclient import TestClient

from pdserve.entrypoints import api_server, serve, serve_args
from pdserve.server.async_engine import EngineThread
from tests.server.fake_engine import FakeEngine


class ThreadRecordingEngine(FakeEngine):
    """Notes the thread it was built on and every thread that stepped it."""

    def __init__(self, **_):
        super().__init__()
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()

    def step(self):
        self.stepped_on.add(threading.get_ident())
        return super().step()


def test_engine_thread_runs_calls_in_order_and_hands_back_results_and_errors():
    t = EngineThread()
    assert t.call(threading.get_ident) == t.thread.ident != threading.get_ident()
    order = []
    futures = [t.submit(order.append, i) for i in range(20)]
    assert [f.result(timeout=5) for f in futures] == [None] * 20 and order == list(range(20))
    with pytest.raises(ValueError, match="invalid literal"):
        t.call(int, "not a number")
    assert t.call(sum, [1, 2, 3]) == 6   # still serving after a call raised


def test_serve_builds_and_steps_the_engine_on_one_thread(monkeypatch):
    engines = []

    def build(**_):
        engines.append(ThreadRecordingEngine())
        return engines[-1]

    def serve_one_request(server, sockets=None):   # stands in for uvicorn: the app's lifespan starts the engine loop
        with TestClient(server.config.app, base_url="http://127.0.0.1") as c:   # a Host --allowed-hosts takes
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"

    monkeypatch.setattr("pdserve.engine.llm_engine.LLMEngine", build)
    monkeypatch.setattr(api_server._Server, "run", serve_one_request)
    monkeypatch.setattr(api_server.signal, "signal", lambda *_: None)   # keep pytest's own handlers
    parser = argparse.ArgumentParser()
    serve_args.add_arguments(parser)
    serve.run(parser.parse_args(["--port", "0"]))
    (engine,) = engines
    assert engine.stepped_on == {engine.built_on} and engine.built_on != threading.get_ident()
