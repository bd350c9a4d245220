"""Which worker gets a request: round-robin, least-loaded (fewest in flight at the proxy),
prefix-aware (the prefill worker sent most of the prompt's leading blocks)."""
import threading

import httpx
import pytest

from pdserve.errors import ConfigError
from pdserve.proxy.workers import Pool, Worker, worker_url
from pdserve.routing import Router
from tests.proxy.fake_worker import FakeWorker


def workers(n: int) -> list[Worker]:
    return [Worker(f"http://w{i}", "decode") for i in range(n)]


def load(pool: Pool, *counts: int) -> None:
    for w, n in zip(pool.workers, counts):
        for _ in range(n):
            pool.router.sent(w)


def test_round_robin_takes_turns_whatever_the_load():
    r = Pool(workers(3), Router("round-robin"))
    load(r, 5)
    assert [r.choose().url for _ in range(6)] == ["http://w0", "http://w1", "http://w2"] * 2


def test_least_loaded_takes_the_fewest_in_flight_and_idle_ones_take_turns():
    r = Pool(workers(3), Router("least-loaded"))
    ws = r.workers
    assert [r.choose().url for _ in range(3)] == ["http://w0", "http://w1", "http://w2"]
    load(r, 2, 0, 1)
    assert {r.choose().url for _ in range(4)} == {"http://w1"}
    with r.busy(ws[1]), r.busy(ws[1]), r.busy(ws[1]):
        assert r.in_flight(ws[1]) == 3 and r.choose().url == "http://w2"
    assert r.in_flight(ws[1]) == 0


def test_worker_urls_are_normalized_and_bad_ones_refused():
    assert worker_url("127.0.0.1:8100") == "http://127.0.0.1:8100"
    assert worker_url("http://h:1/v1/") == "http://h:1"
    for bad in ("ftp://h:1", "http://", "http://h:port"):
        with pytest.raises(ValueError):
            worker_url(bad)
    with pytest.raises(ValueError, match="routing"):
        Router("random")
    with pytest.raises(ValueError, match="at least one worker"):
        Pool([], Router())


def _post(url: str, **body):
    return httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body}, timeout=30)


def test_round_robin_through_the_proxy_alternates_workers(cluster):
    prefill = [FakeWorker("prefill"), FakeWorker("prefill")]
    decode = [FakeWorker("decode"), FakeWorker("decode")]
    url = cluster(prefill, decode).url
    for _ in range(4):
        assert _post(url).status_code == 200
    assert [len(w.bodies) for w in prefill + decode] == [2, 2, 2, 2]


def test_prefix_aware_sends_a_prompt_to_the_prefill_worker_sent_its_prefix(cluster, tiny_llama):
    prefill = [FakeWorker("prefill"), FakeWorker("prefill")]
    c = cluster(prefill, flags=["--routing", "prefix-aware", "--tokenizer", tiny_llama])
    a = "The quick brown fox jumps over the lazy dog. " * 6
    b = "Pack my box with five dozen liquor jugs, said the sphinx. " * 6
    order = [a, b, b + "Once more?", a + "And then?"]   # round-robin (or idle least-loaded): 0 1 0 1
    for prompt in order:
        assert _post(c.url, prompt=prompt).status_code == 200
    where = {body["prompt"]: i for i, w in enumerate(prefill) for body in w.bodies}
    assert where[order[0]] == where[order[3]] != where[order[1]] == where[order[2]]


def test_prefix_aware_needs_the_tokenizer(cluster):
    with pytest.raises(ConfigError, match="--tokenizer"):
        cluster(flags=["--routing", "prefix-aware"])


def test_least_loaded_through_the_proxy_avoids_the_worker_with_a_stream_in_flight(cluster):
    decode = [FakeWorker("decode", token_delay=0.05), FakeWorker("decode", token_delay=0.05)]
    c = cluster(decode=decode, flags=["--routing", "least-loaded"])
    started, done = threading.Event(), threading.Event()

    def long_stream():   # 40 s of tokens, until the test is done with it
        with httpx.stream("POST", c.url + "/v1/completions", timeout=30,
                          json={"prompt": "Hi", "max_tokens": 800, "stream": True}) as r:
            for _ in r.iter_lines():
                started.set()
                if done.is_set():
                    break
    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(10)
    busy = next(w for w in decode if w.bodies)
    for _ in range(3):   # round-robin would send one or two of them to the busy worker
        assert _post(c.url).status_code == 200
    idle = next(w for w in decode if w is not busy)
    assert len(busy.bodies) == 1 and len(idle.bodies) == 3
    done.set()
    t.join(30)
