"""The proxy against fake workers of the contract, through the official openai client."""
import httpx
import openai
import pytest

from tests.proxy.fake_worker import LEASES, FakeWorker, text

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Hi"}]


def client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_go_through_a_prefill_then_a_decode_worker(cluster, stream):
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    c = client(cluster([prefill], [decode]).url)
    if stream:
        chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, stream=True, temperature=0,
                                           stream_options={"include_usage": True}))
        got = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert chunks[-1].usage.completion_tokens == 5
    else:
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
        got = r.choices[0].text
        assert r.usage.completion_tokens == 5
    assert got == text(5)
    # the contract: the prefill worker gets one token, not streamed, one choice, the KV kept for
    # the decode worker chosen first ...
    (p,) = prefill.bodies
    assert p["max_tokens"] == 1 and p["stream"] is False and p["n"] == 1
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "decode_engine_id": decode.engine_id}
    assert "stream_options" not in p
    assert p["prompt"] == PROMPT
    # ... the decode worker the client's own body and the params the prefill worker returned
    (d,) = decode.bodies
    assert d["max_tokens"] == 5 and d.get("stream", False) is stream and d["prompt"] == PROMPT
    assert d["kv_transfer_params"]["do_remote_prefill"] is True
    assert d["kv_transfer_params"]["remote_engine_id"] == prefill.engine_id
    assert d["kv_transfer_params"]["remote_request_id"] not in LEASES   # released by the decode worker


@pytest.mark.parametrize("stream", [False, True])
def test_chat_goes_through_a_prefill_then_a_decode_worker(cluster, stream):
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    c = client(cluster([prefill], [decode]).url)
    if stream:
        chunks = list(c.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=4, stream=True))
        got = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        got = c.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=4).choices[0].message.content
    assert got == text(4)
    (p,) = prefill.bodies
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["messages"] == CHAT
    (d,) = decode.bodies
    assert d["max_completion_tokens"] == 4 and "max_tokens" not in d


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_refusal_reaches_the_client_unchanged(cluster, role, stream):
    workers = {"prefill": [FakeWorker("prefill")], "decode": [FakeWorker("decode")]}
    workers[role] = [FakeWorker(role, behaviour="refuse")]
    c = client(cluster(workers["prefill"], workers["decode"]).url)
    with pytest.raises(openai.BadRequestError) as e:
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, stream=stream)
        list(r) if stream else None
    assert e.value.body == {"message": "temperature: refused by the fake", "type": "invalid_request_error",
                            "param": "temperature", "code": None}


def test_a_busy_worker_503_and_its_retry_after_pass_through(cluster):
    url = cluster(decode=[FakeWorker("decode", behaviour="refuse", refusal=(503, "queue"))]).url
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["param"] == "queue"


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_that_is_gone_is_a_503_naming_it(cluster, role, stream):
    workers = {"prefill": [FakeWorker("prefill")], "decode": [FakeWorker("decode")]}
    url = cluster(workers["prefill"], workers["decode"]).url
    workers[role][0].served.stop()   # after the proxy checked it
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": stream}, timeout=30)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "worker_unavailable" and f"{role} worker {workers[role][0].url}" in err["message"]


def sse_events(r: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": PROMPT}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_a_decode_worker_that_dies_mid_stream_ends_it_with_an_error_event(cluster, path, body):
    url = cluster(decode=[FakeWorker("decode", behaviour="die")]).url
    with httpx.stream("POST", url + path, json={**body, "max_tokens": 8, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r)
    tokens = [e for e in events[:-2] if '"error"' not in e]
    assert len(tokens) >= 3   # what it sent before it died reached the client
    assert '"code": "worker_failed"' in events[-2] and "decode worker" in events[-2]
    assert events[-1] == "[DONE]"
    # the official client raises on it
    c = client(url)
    with pytest.raises(openai.APIError, match="broke off its answer"):
        list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, stream=True))


def test_a_decode_worker_that_dies_mid_answer_is_a_502(cluster):
    url = cluster(decode=[FakeWorker("decode", behaviour="die")]).url
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_that_hangs_times_out_instead_of_hanging_the_client(cluster, role):
    workers = {"prefill": [FakeWorker("prefill")], "decode": [FakeWorker("decode")]}
    workers[role] = [FakeWorker(role, behaviour="hang")]
    url = cluster(workers["prefill"], workers["decode"], flags=["--read-timeout", "0.5"]).url
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "worker_timeout"
    assert f"{role} worker" in r.json()["error"]["message"]


def test_a_stream_that_stalls_ends_with_an_error_event(cluster):
    url = cluster(decode=[FakeWorker("decode", behaviour="stall")], flags=["--read-timeout", "0.5"]).url
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "stream": True},
                      timeout=30) as r:
        events = sse_events(r)
    assert len(events) == 5 and '"code": "worker_timeout"' in events[-2] and events[-1] == "[DONE]"


def test_a_body_that_is_not_a_json_object_is_a_400_without_calling_a_worker(cluster):
    prefill = FakeWorker("prefill")
    url = cluster([prefill]).url
    for content in (b"[1, 2]", b"{not json"):
        r = httpx.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert not prefill.bodies


def test_models_are_the_decode_workers_and_health_covers_every_worker(cluster):
    decode = FakeWorker("decode")
    url = cluster(decode=[decode]).url
    assert client(url).models.list().data[0].id == "tiny"
    r = httpx.get(url + "/health")
    assert r.status_code == 200 and set(r.json()["workers"].values()) == {"ok"}
    decode.served.stop()
    r = httpx.get(url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unhealthy"
    assert f"decode {decode.url}: unreachable" in r.json()["error"]["message"]
