"""The proxy's own /metrics: requests by outcome, phase latencies, requests in flight per worker."""
import threading

import httpx

from pdserve.bench.servers import scrape_metrics
from tests.proxy.fake_worker import FakeWorker
from tests.proxy.test_disconnect import wait_until


def test_metrics_count_outcomes_phases_and_in_flight_requests(cluster):
    decode = FakeWorker("decode", token_delay=0.05)
    c = cluster(decode=[decode])
    prefill_url = c.proxy.prefill.workers[0].url
    flight = f'pdserve:proxy_worker_in_flight{{role="decode",worker="{decode.url}"}}'
    started, stop = threading.Event(), threading.Event()

    def stream():
        with httpx.stream("POST", c.url + "/v1/completions", timeout=30,
                          json={"prompt": "Hi", "max_tokens": 100, "stream": True}) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    break   # leaves: the stream is cancelled
    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(10)
    m = scrape_metrics(c.url)
    assert m[flight] == 1 and m[f'pdserve:proxy_worker_in_flight{{role="prefill",worker="{prefill_url}"}}'] == 0
    stop.set()
    t.join(30)
    assert httpx.post(c.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert httpx.post(c.url + "/v1/chat/completions", json={"messages": [], "max_tokens": 2, "stream": True}
                      ).status_code == 200
    decode.behaviour = "refuse"
    assert httpx.post(c.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 400
    wait_until(lambda: scrape_metrics(c.url)[flight] == 0)
    m = scrape_metrics(c.url)
    ok = 'pdserve:proxy_requests_total{endpoint="%s",outcome="%s"}'
    assert m[ok % ("completions", "cancelled")] == 1
    assert m[ok % ("completions", "success")] == 1
    assert m[ok % ("chat", "success")] == 1
    assert m[ok % ("completions", "client_error")] == 1
    assert m["pdserve:proxy_prefill_seconds_count"] == 4
    assert m["pdserve:proxy_decode_ttft_seconds_count"] == 2   # the two streams
    assert m["pdserve:proxy_time_to_first_token_seconds_count"] == 2
    assert m["pdserve:proxy_e2e_request_latency_seconds_count"] == 4


def test_a_failure_counts_under_its_outcome(cluster):
    c = cluster(decode=[FakeWorker("decode", behaviour="die")])
    httpx.post(c.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "stream": True}, timeout=30)
    httpx.post(c.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 8}, timeout=30)
    m = scrape_metrics(c.url)
    assert m['pdserve:proxy_requests_total{endpoint="completions",outcome="broken"}'] == 2
