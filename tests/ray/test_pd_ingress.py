"""The P/D ingress's two calls against fake pools (no Ray): what each pool is sent, what the client
gets back, refusals, a replica that fails before or while answering, and --ray-retry-failed."""
import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request

from pdserve.ray.pd_ingress import PDIngress

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_host": "10.0.0.1", "remote_port": 7000,
          "remote_request_id": "r1", "num_tokens": 9, "transport": "tcp", "block_size": 16, "dtype": "float32"}


class ReplicaDied(Exception):
    pass


class FakeStream:
    """What a Serve handle's streaming call gives: the replica's head, then its body chunks;
    `fail_at`: the item at which the replica dies."""

    def __init__(self, items: list, fail_at: int | None = None):
        self.items, self.fail_at, self.cancelled = list(items), fail_at, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.fail_at == 0:
            raise ReplicaDied("the actor died")
        if not self.items:
            raise StopAsyncIteration
        if self.fail_at is not None:
            self.fail_at -= 1
        return self.items.pop(0)

    def cancel(self):
        self.cancelled = True


class FakePool:
    """A DeploymentHandle whose replicas answer with answers[i] for the i-th call."""

    def __init__(self, *answers):
        self.answers, self.calls, self.streams = list(answers), [], []

    def options(self, **_):
        return self

    @property
    def forward(self):
        return self

    def remote(self, method, path, query, headers, body, block_hashes=None):
        self.calls.append({"method": method, "path": path, "headers": dict(headers), "body": body,
                           "hashes": block_hashes})
        stream = self.answers.pop(0)
        self.streams.append(stream)
        return stream


def head(status: int = 200, content_type: bytes = b"application/json", replica: bytes = b"p1"):
    return {"status": status, "headers": [(b"content-type", content_type), (b"x-pdserve-replica", replica),
                                          (b"x-pdserve-node", b"node-" + replica)]}


def prefill_ok(**extra):
    return FakeStream([head(), json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS,
                                           **extra}).encode()])


def client(model: str, prefill: FakePool, decode: FakePool, retry: bool = False) -> httpx.AsyncClient:
    ingress = PDIngress(prefill, decode, model, 16, retry_failed=retry, decode_engine_id="decode-pool")
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def route(request: Request):
        return await ingress.forward(request)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress")


def run(coro):
    return asyncio.run(coro)


BODY = {"prompt": "Once upon a time there was a little cat who lived in a big house by the sea", "max_tokens": 20,
        "temperature": 0, "stream": False}


def test_the_prefill_pool_gets_one_token_and_the_decode_pool_the_request_with_its_kv(tiny_llama):
    prefill = FakePool(prefill_ok())
    decode = FakePool(FakeStream([head(replica=b"d1"), b'{"choices": [{"text": "the answer"}]}']))

    async def go():
        async with client(tiny_llama, prefill, decode) as c:
            return await c.post("/v1/completions", json=BODY, headers={"authorization": "Bearer k"})
    r = run(go())
    assert r.status_code == 200 and r.json() == {"choices": [{"text": "the answer"}]}
    assert r.headers["x-pdserve-replica"] == "d1" and r.headers["x-pdserve-prefill-replica"] == "p1"
    assert r.headers["x-pdserve-prefill-node"] == "node-p1"
    sent = json.loads(prefill.calls[0]["body"])
    assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["kv_transfer_params"] == {
        "do_remote_decode": True, "decode_engine_id": "decode-pool"}   # the lease is for the decode pool
    assert prefill.calls[0]["hashes"]   # routed by the prompt's blocks
    assert json.loads(decode.calls[0]["body"]) == {**BODY, "kv_transfer_params": PARAMS}
    assert decode.calls[0]["hashes"] == []
    for call in prefill.calls + decode.calls:   # the client's headers, with the new body's length
        assert call["headers"][b"authorization"] == b"Bearer k"
        assert int(call["headers"][b"content-length"]) == len(call["body"])


def test_a_refusal_of_the_prefill_replica_reaches_the_client_unchanged(tiny_llama):
    refusal = json.dumps({"error": {"message": "temperature must be >= 0", "type": "invalid_request_error",
                                    "param": "temperature", "code": None}}).encode()
    prefill, decode = FakePool(FakeStream([head(400), refusal])), FakePool()

    async def go():
        async with client(tiny_llama, prefill, decode) as c:
            return await c.post("/v1/completions", json=BODY)
    r = run(go())
    assert r.status_code == 400 and r.content == refusal and not decode.calls


def test_a_prefill_answer_without_kv_params_is_a_502(tiny_llama):
    prefill = FakePool(FakeStream([head(), b'{"choices": [{"text": "x"}]}']))

    async def go():
        async with client(tiny_llama, prefill, FakePool()) as c:
            return await c.post("/v1/completions", json=BODY)
    r = run(go())
    assert r.status_code == 502 and r.json()["error"]["code"] == "bad_worker_response"


def test_a_body_that_is_not_json_is_a_400_and_reaches_no_pool(tiny_llama):
    prefill, decode = FakePool(), FakePool()

    async def go():
        async with client(tiny_llama, prefill, decode) as c:
            return await c.post("/v1/completions", content=b"{nope")
    r = run(go())
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert not prefill.calls and not decode.calls


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_a_replica_that_dies_before_answering_is_a_503_or_retried(tiny_llama, pool):
    def pools(*first):
        p = FakePool(*first, prefill_ok()) if pool == "prefill" else FakePool(prefill_ok())
        d = FakePool(*first, FakeStream([head(replica=b"d2"), b'{"ok": 1}'])) if pool == "decode" else \
            FakePool(FakeStream([head(replica=b"d2"), b'{"ok": 1}']))
        return p, d

    async def go(p, d, retry):
        async with client(tiny_llama, p, d, retry) as c:
            return await c.post("/v1/completions", json=BODY)
    p, d = pools(FakeStream([], fail_at=0))
    r = run(go(p, d, False))
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed"
    assert (p if pool == "prefill" else d).streams[0].cancelled
    if pool == "prefill":
        assert not d.calls
    p, d = pools(FakeStream([], fail_at=0))
    r = run(go(p, d, True))
    assert r.status_code == 200 and r.json() == {"ok": 1}
    assert len((p if pool == "prefill" else d).calls) == 2   # the call went again


def test_a_decode_replica_that_dies_mid_stream_ends_the_stream_with_an_error_event(tiny_llama):
    events = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n']
    decode = FakePool(FakeStream([head(content_type=b"text/event-stream"), *events], fail_at=3))

    async def go():
        async with client(tiny_llama, FakePool(prefill_ok()), decode) as c:
            return await c.post("/v1/completions", json={**BODY, "stream": True})
    r = run(go())
    lines = [line for line in r.text.split("\n\n") if line]
    assert r.status_code == 200 and lines[:2] == [e.decode().strip() for e in events]
    assert json.loads(lines[2][len("data: "):])["error"]["code"] == "replica_failed" and lines[3] == "data: [DONE]"
    assert decode.streams[0].cancelled


def test_other_endpoints_go_to_the_decode_pool_as_they_came(tiny_llama):
    prefill, decode = FakePool(), FakePool(FakeStream([head(replica=b"d1"), b'{"data": []}']))

    async def go():
        async with client(tiny_llama, prefill, decode) as c:
            return await c.get("/v1/models")
    r = run(go())
    assert r.status_code == 200 and r.json() == {"data": []} and not prefill.calls
    assert decode.calls[0]["method"] == "GET" and decode.calls[0]["path"] == "/v1/models"
