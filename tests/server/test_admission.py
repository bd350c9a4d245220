"""API key, and the bounded waiting queue: a server with a key, one running sequence at a
time and room for two waiting requests."""
import contextlib
import time

import httpx
import pytest

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG_CHAT = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 1000,
             "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def guarded(start_server, tiny_llama):
    # the key comes from the environment variable, which --api-key defaults to
    return start_server(tiny_llama, "--max-waiting", "2", "--max-num-seqs", "1", env={"PDSERVE_API_KEY": KEY})


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
                         ids=["no key", "wrong key", "no Bearer"])
def test_requests_without_the_key_get_401(guarded, headers):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/generate"),
                         ("POST", "/tokenize")]:
        r = httpx.request(method, guarded.url + path, json={"prompt": "Hi"}, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_the_right_key_is_accepted_and_probes_stay_open(guarded):
    assert httpx.get(guarded.url + "/v1/models", headers=AUTH).status_code == 200
    r = httpx.post(guarded.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(guarded.url + path).status_code == 200


def test_full_queue_gets_503_fast_while_health_answers(guarded):
    with contextlib.ExitStack() as stack, httpx.Client(base_url=guarded.url, headers=AUTH, timeout=30) as client:
        readers = []   # a line iterator that is garbage-collected closes its connection: keep them

        def open_stream(events: int):
            r = stack.enter_context(client.stream("POST", "/v1/chat/completions", json=LONG_CHAT))
            assert r.status_code == 200
            readers.append(r.iter_lines())
            # the first event (the role) is sent once the request is admitted; later ones carry tokens
            assert sum(next(readers[-1]).startswith("data: ") for _ in range(2 * events)) == events
        open_stream(events=2)   # running (--max-num-seqs 1)
        open_stream(events=1)   # waiting
        open_stream(events=1)   # waiting: the queue (--max-waiting 2) is now full
        t0 = time.perf_counter()
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        elapsed = time.perf_counter() - t0
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        assert elapsed < 1.0
        assert client.get("/health").status_code == 200
        assert guarded.metrics()["pdserve:num_requests_waiting"] == 2
    # the three streams were dropped: everything is aborted and freed, and requests are admitted again
    guarded.wait_for(lambda m: m["pdserve:num_requests_running"] == 0 and m["pdserve:kv_cache_usage_perc"] == 0
                     and m["pdserve:num_requests_waiting"] == 0)
    r = httpx.post(guarded.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=30)
    assert r.status_code == 200
