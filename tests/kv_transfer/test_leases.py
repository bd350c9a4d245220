"""The proxy releases a lease whose decode call does not go through (issue 38, item 6): a real
prefill worker, a fake decode worker that refuses or never answers, and the proxy with the
deployment's secret. The prefill worker's leases go back to 0 long before --kv-lease-s."""
import json
import socket

import httpx
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.entrypoints import proxy as launch
from tests.kv_transfer.pd import ENGINE, SECRET
from tests.proxy.conftest import Served, proxy_args
from tests.proxy.fake_worker import FakeWorker
from tests.proxy.test_disconnect import wait_until
from tests.server.inprocess import serve

BODY = {"prompt": "Once upon a time there was a little robot who lived in a lighthouse", "max_tokens": 8}


@pytest.fixture(scope="module")
def prefill(tiny_qwen2):
    """(the prefill worker's URL, its engine), leases of an hour: an expiry never frees one here."""
    engine = LLMEngine(tiny_qwen2, role="prefill", kv_transfer_secret=SECRET, kv_lease_s=3600, **ENGINE)
    with serve(engine) as url:
        yield url, engine


@pytest.fixture
def proxied(prefill):
    """proxied(decode FakeWorker) -> the URL of a proxy over the prefill worker and that decode worker."""
    started = []

    def start(decode: FakeWorker) -> str:
        decode.served = Served(decode.app)
        app, _ = launch.build(proxy_args([prefill[0]], [decode.served.url], "--kv-transfer-secret", SECRET))
        started.extend([decode.served, Served(app)])
        return started[-1].url
    yield start
    for s in reversed(started):
        s.stop()


def leases(prefill) -> int:
    return len(prefill[1].connector.leases)


@pytest.mark.parametrize("status", [400, 503])
def test_a_refused_decode_call_releases_the_lease(prefill, proxied, status):
    decode = FakeWorker("decode", behaviour="refuse", refusal=(status, "max_tokens"))
    r = httpx.post(proxied(decode) + "/v1/completions", json=BODY, timeout=120)
    assert r.status_code == status and r.json()["error"]["param"] == "max_tokens"
    lease = decode.bodies[0]["kv_transfer_params"]
    assert lease["decode_engine_id"] == decode.engine_id   # the lease was made for the worker chosen first
    wait_until(lambda: leases(prefill) == 0, timeout=120)


def test_a_client_gone_between_the_two_calls_releases_the_lease(prefill, proxied):
    decode = FakeWorker("decode", behaviour="hang")   # the decode call never answers
    host, port = proxied(decode).removeprefix("http://").split(":")
    body = json.dumps(BODY).encode()
    with socket.create_connection((host, int(port))) as s:   # leaves once the prefill has answered
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: decode.bodies, timeout=120)
        assert leases(prefill) == 1
    wait_until(lambda: leases(prefill) == 0, timeout=120)


def test_the_proxy_takes_the_secret_from_the_environment_as_the_workers_do(prefill, monkeypatch):
    decode = FakeWorker("decode")
    served = Served(decode.app)
    try:
        monkeypatch.setenv("PDSERVE_KV_TRANSFER_SECRET", SECRET)
        app, _ = launch.build(proxy_args([prefill[0]], [served.url]))
        assert app.state.proxy.kv_secret == SECRET
        monkeypatch.delenv("PDSERVE_KV_TRANSFER_SECRET")
        app, _ = launch.build(proxy_args([prefill[0]], [served.url], "--kv-transfer-secret", "given"))
        assert app.state.proxy.kv_secret == "given"
    finally:
        served.stop()
