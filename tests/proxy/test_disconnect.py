"""A client that leaves cancels the worker's request: the decode worker sees its connection
close (a real one then aborts the request and releases the prefill worker's lease)."""
import json
import socket
import time

import httpx
import pytest

from tests.proxy.fake_worker import LEASES, FakeWorker


def wait_until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Hi"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_a_client_leaving_mid_stream_aborts_the_decode_request(cluster, path, body):
    decode = FakeWorker("decode", token_delay=0.05)
    c = cluster(decode=[decode])
    with httpx.stream("POST", c.url + path, json={**body, "max_tokens": 200, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        assert sum(next(lines).startswith("data: ") for _ in range(6)) == 3
        assert decode.running == 1
    wait_until(lambda: decode.running == 0)
    assert decode.aborted == 1 and decode.bodies[0]["kv_transfer_params"]["remote_request_id"] not in LEASES
    wait_until(lambda: c.proxy.decode.in_flight(c.proxy.decode.workers[0]) == 0)


def test_a_client_leaving_a_plain_request_aborts_the_decode_request(cluster):
    decode = FakeWorker("decode", token_delay=0.5)   # 100 s unless aborted
    c = cluster(decode=[decode])
    host, port = c.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Hi", "max_tokens": 200}).encode()
    with socket.create_connection((host, int(port))) as s:   # leaves once the decode worker has the request
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: decode.running == 1, timeout=60)
    wait_until(lambda: decode.aborted == 1)
    assert decode.running == 0 and decode.bodies[0]["kv_transfer_params"]["remote_request_id"] not in LEASES


def test_a_client_leaving_during_the_prefill_cancels_the_prefill_call(cluster):
    prefill = FakeWorker("prefill", behaviour="hang")
    decode = FakeWorker("decode")
    c = cluster([prefill], [decode])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(c.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True},
                   timeout=httpx.Timeout(30, read=0.3))
    wait_until(lambda: c.proxy.prefill.in_flight(c.proxy.prefill.workers[0]) == 0)
    assert not decode.bodies
