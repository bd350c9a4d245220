"""Slow clients and too many connections, against a real uvicorn on 127.0.0.1 with pdserve's
guarded h11 protocol (short limits, so the test is quick), on the fake engine."""
import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from pdserve.server.app import build_app
from pdserve.server.connections import guarded_protocol
from pdserve.server.config import ServerConfig
from tests.server.conftest import free_port
from tests.server.fake_engine import FakeEngine


@contextlib.contextmanager
def running_app(engine, header_timeout=30.0, body_timeout=30.0, max_connections=1000, **config):
    """(host, port) of the app served by uvicorn in a thread; stopped on exit."""
    app = build_app(engine, ServerConfig(served_model_name="fake-model", **config))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=guarded_protocol(header_timeout, body_timeout, max_connections)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(30)


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `seconds` (while the client sends nothing more), and what it sent."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return False, received
    except ConnectionResetError:
        pass
    return True, received


def test_slow_headers_and_slow_bodies_are_cut_off():
    with running_app(FakeEngine(), header_timeout=1.0, body_timeout=1.0) as (host, port):
        t0 = time.monotonic()
        silent = socket.create_connection((host, port))          # connects, sends nothing
        slow_headers = socket.create_connection((host, port))    # a header line trickling in
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow_body = socket.create_connection((host, port))       # full headers, half a body
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        for _ in range(3):   # a byte every 0.4 s would restart uvicorn's own keep-alive timer
            time.sleep(0.4)
            slow_headers.sendall(b"X")
        for sock, what in ((silent, "silent"), (slow_headers, "slow headers"), (slow_body, "slow body")):
            closed, received = closed_within(sock, 3.0)
            assert closed, f"{what}: still open after {time.monotonic() - t0:.1f} s"
            sock.close()
        # a healthy client is served meanwhile and afterwards
        r = httpx.post(f"http://{host}:{port}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200


def test_slow_headers_get_a_408():
    with running_app(FakeEngine(), header_timeout=0.5) as (host, port), socket.create_connection((host, port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # never ends its headers
        closed, received = closed_within(s, 3.0)
        assert closed and received.startswith(b"HTTP/1.1 408") and b"--header-timeout" in received


def test_a_long_generation_is_not_a_slow_client():
    # the deadlines cover reading the request; the response may take as long as it takes
    with running_app(FakeEngine(step_time=0.05), header_timeout=0.5, body_timeout=0.5) as (host, port):
        with httpx.Client(base_url=f"http://{host}:{port}", timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 30})   # about 1.5 s
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200   # kept alive


def test_connections_beyond_the_cap_get_503():
    with running_app(FakeEngine(), max_connections=3) as (host, port):
        held = [socket.create_connection((host, port)) for _ in range(3)]
        time.sleep(0.2)
        with socket.create_connection((host, port)) as extra:
            closed, received = closed_within(extra, 3.0)
            assert closed and received.startswith(b"HTTP/1.1 503") and b"too_many_connections" in received
        for s in held:
            s.close()
        time.sleep(0.2)
        assert httpx.get(f"http://{host}:{port}/health").status_code == 200
