"""The model list and tokenizer forwarded to a decode worker: only the paths the proxy names reach
it, whatever path a client sends, and no forwarded answer holds a worker connection past its
deadline, its client, or the proxy's shutdown."""
import http.client
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from pdserve.bench.servers import free_port
from tests.proxy.fake_worker import FakeWorker
from tests.proxy.test_disconnect import wait_until

TRAVERSALS = [
    "/v1/models/..%2F..%2Fv1%2Fengine%2Fsteps",
    "/v1/models/..%2f..%2fmetrics",
    "/v1/models/%2e%2e%2F%2e%2e%2Fv1%2Fkv_transfer",
    "/v1/models/%252e%252e%252F%252e%252e%252Fmetrics",      # double-encoded
    "/v1/models/..%252F..%252Fv1%252Fengine%252Fsteps",
    "/v1/models/..%5C..%5Cmetrics",                          # backslashes, encoded and not
    "/v1/models/..\\..\\metrics",
    "/v1/models/../../metrics",                              # as sent, not normalized by a client
    "/v1/models/tiny/../../metrics",
    "/v1/models/tiny%2F..%2F..%2F..%2Fmetrics",
    "/v1/models/%2F%2F127.0.0.1%2Fmetrics",
    "/v1/models/..;/..;/metrics",
    "/v1/models%2F..%2F..%2Fmetrics",
]


def raw_get(url: str, path: str) -> tuple[int, dict | str]:
    """GET `path` exactly as written (httpx would normalize the dots)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read().decode()
        return r.status, (httpx.Response(200, content=body).json()
                          if r.getheader("content-type", "").startswith("application/json") else body)
    finally:
        conn.close()


@pytest.fixture
def worker_paths():
    """The paths a decode worker may be asked for through the proxy."""
    return {"/v1/kv_transfer", "/health", "/v1/models", "/tokenize", "/detokenize"}


@pytest.mark.parametrize("path", TRAVERSALS)
def test_a_model_id_cannot_reach_another_route_of_the_worker(cluster, worker_paths, path):
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    c = cluster([prefill], [decode])
    status, body = raw_get(c.url, path)
    assert status == 404, body
    assert body["error"]["code"] in ("model_not_found", 404), body
    assert set(prefill.paths + decode.paths) <= worker_paths
    assert "pdserve:secret" not in str(body)


@pytest.mark.parametrize("path", ["/v1/engine/steps", "/v1/kv_transfer", "/v1/x/..%2F..%2Fmetrics",
                                  "/tokenize/..%2F..%2Fmetrics"])
def test_a_path_the_proxy_does_not_name_is_its_own_404(cluster, worker_paths, path):
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    c = cluster([prefill], [decode])
    status, body = raw_get(c.url, path)
    assert status == 404 and body["error"]["code"] == 404, body
    assert set(prefill.paths + decode.paths) <= worker_paths


def test_a_model_is_found_by_its_id_even_with_slashes(cluster):
    decode = FakeWorker("decode", model="org/tiny-v1")
    c = cluster([FakeWorker("prefill", model="org/tiny-v1")], [decode])
    r = httpx.get(c.url + "/v1/models/org/tiny-v1", timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "org/tiny-v1"
    r = httpx.get(c.url + "/v1/models/org%2Ftiny-v2", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "`org/tiny-v2` does not exist" in r.json()["error"]["message"]
    assert decode.paths.count("/v1/models") == 2


@pytest.mark.parametrize("models,status,code", [("trickle", 504, "worker_timeout"), ("hang", 504, "worker_timeout"),
                                                ("flood", 502, "worker_failed")])
def test_a_forwarded_answer_that_never_ends_is_bounded(cluster, models, status, code):
    decode = FakeWorker("decode", models=models)
    # the trickle sends a byte every 0.05 s, so only a deadline on the whole answer ends it
    # (a flood is bounded by 16 x --max-body-bytes)
    flags = ["--read-timeout", "1"] if models != "flood" else ["--read-timeout", "600", "--max-body-bytes", "4096"]
    c = cluster(decode=[decode], flags=flags)
    r = httpx.get(c.url + "/v1/models", timeout=120)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    wait_until(lambda: decode.listing == 0, timeout=60)   # the worker connection was closed


@pytest.mark.parametrize("health,status", [("trickle", 200), ("hang", 503)])
def test_a_worker_health_answer_that_never_ends_does_not_hold_the_proxys(cluster, health, status):
    """Only the status line of a worker's /health is read, within 2 s."""
    decode = FakeWorker("decode")
    c = cluster(decode=[decode])
    decode.models = health   # after the pairing check
    r = httpx.get(c.url + "/health", timeout=60)
    assert r.status_code == status, r.text
    if status == 503:
        assert f"decode {decode.url}: unreachable (" in r.json()["error"]["message"]
    wait_until(lambda: decode.listing == 0, timeout=60)


def test_clients_that_leave_do_not_exhaust_the_pool(cluster):
    """2 x --max-connections clients each leave a never-ending model list: each worker call is
    closed when its client goes, and /health (and the model list) still answer."""
    decode = FakeWorker("decode", models="trickle")
    c = cluster(decode=[decode], flags=["--max-connections", "4"])
    host, port = c.url.removeprefix("http://").split(":")
    for i in range(8):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            wait_until(lambda: decode.paths.count("/v1/models") == i + 1, timeout=60)
    wait_until(lambda: decode.listing == 0, timeout=60)
    r = httpx.get(c.url + "/health", timeout=60)
    assert r.status_code == 200, r.text
    decode.models = "ok"
    assert httpx.get(c.url + "/v1/models", timeout=60).json()["data"][0]["id"] == "tiny"


def answers_version(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/version", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigterm_with_forwards_in_flight_ends_them_at_the_shutdown_timeout(tmp_path):
    """`pdserve proxy` stopped while model lists are still being read: the clients get 503
    shutdown_timeout when --shutdown-timeout runs out, and the proxy exits without a traceback."""
    from tests.proxy.conftest import Served

    prefill, decode = FakeWorker("prefill"), FakeWorker("decode", models="trickle")
    for w in (prefill, decode):
        w.served = Served(w.app)
        w.url = w.served.url
    port = free_port()
    err = tmp_path / "stderr.log"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "proxy", "--prefill", prefill.url, "--decode",
                             decode.url, "--port", str(port), "--shutdown-timeout", "1"],
                            stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    answers = []

    def get():
        answers.append(httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=120))
    try:
        wait_until(lambda: answers_version(port) or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, err.read_text()
        clients = [threading.Thread(target=get) for _ in range(3)]
        for t in clients:
            t.start()
        wait_until(lambda: decode.listing == 3, timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
        for t in clients:
            t.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in (prefill, decode):
            w.served.stop()
    log = err.read_text()
    assert "Traceback" not in log and "Cancel" not in log, log
    assert [r.status_code for r in answers] == [503] * 3
    assert {r.json()["error"]["code"] for r in answers} == {"shutdown_timeout"}
    wait_until(lambda: decode.listing == 0, timeout=60)
