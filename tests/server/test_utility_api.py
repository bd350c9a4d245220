"""tokenize, detokenize, health, version, metrics."""
import httpx

METRICS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
           "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
           "request_decode_time_seconds", "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
           "request_success_total", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
           "cpu_kernel_pool_bytes",
           "step_prefill_tokens", "step_decode_tokens", "step_num_seqs"]


def test_tokenize_detokenize_round_trip(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "The fox jumps."}).json()
    assert r["count"] == len(r["tokens"]) > 2 and r["max_model_len"] == 1024
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "The fox jumps."}
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "The fox jumps."}]})
    assert chat.json()["count"] > r["count"]   # the template adds its markers


def test_health_and_version(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/version").json() == {"version": "0.1.0"}


def test_metrics_exposes_every_documented_name(server):
    httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
    r = httpx.get(server.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    for name in METRICS:
        assert f"# TYPE pdserve:{name} " in r.text, name
    m = server.metrics()
    assert m["pdserve:prompt_tokens_total"] > 0 and m["pdserve:step_prefill_tokens_sum"] > 0
    assert m["pdserve:step_decode_tokens_sum"] > 0
