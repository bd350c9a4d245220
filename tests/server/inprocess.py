"""The app on a real engine, served by uvicorn in a thread of the test process, so a test can
reach into the engine (its fault hook, its block manager) while talking HTTP to it."""
import contextlib
import threading
import time

import uvicorn

from pdserve.server.app import build_app
from pdserve.server.config import ServerConfig
from tests.server.conftest import free_port, wait_for


@contextlib.contextmanager
def serve(engine, **config):
    """Yields the base URL; the server is stopped (and the engine thread joined) on exit."""
    app = build_app(engine, ServerConfig(served_model_name="tiny", **config))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "in-process server did not start"
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def wait_idle(url: str) -> dict[str, float]:
    return wait_for(url, lambda m: m["pdserve:num_requests_running"] == 0 and m["pdserve:num_requests_waiting"] == 0
                    and m["pdserve:kv_cache_usage_perc"] == 0)
