"""Fake workers and the proxy, each served by uvicorn in a thread of the test process."""
import argparse
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn

from pdserve.bench.servers import free_port
from pdserve.entrypoints import proxy as launch
from tests.proxy.fake_worker import FakeWorker


class Served:
    """`app` served on a free loopback port by uvicorn in a thread."""

    def __init__(self, app):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "in-thread server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.server.force_exit = True   # do not wait for open streams
        self.thread.join(30)


def proxy_args(prefill: list[str], decode: list[str], *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return parser.parse_args(["--prefill", *prefill, "--decode", *decode, *flags])


@pytest.fixture
def cluster():
    """cluster(prefill=[FakeWorker...], decode=[...], flags=[...]) -> a namespace with the proxy's
    `url` and `proxy` (relay.Proxy); each fake gets `.url` and `.served`. All stop after the test."""
    started: list[Served] = []

    def start(prefill=None, decode=None, flags=()):
        prefill = prefill or [FakeWorker("prefill")]
        decode = decode or [FakeWorker("decode")]
        for w in prefill + decode:
            w.served = Served(w.app)
            w.url = w.served.url
            started.append(w.served)
        app, _ = launch.build(proxy_args([w.url for w in prefill], [w.url for w in decode], *flags))
        started.append(Served(app))
        return SimpleNamespace(url=started[-1].url, proxy=app.state.proxy)
    yield start
    for s in reversed(started):
        s.stop()
