"""A client that goes away mid-request aborts its engine request; its KV blocks are freed."""
import httpx
import pytest

LONG = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}   # seconds of decoding on the tiny model


def aborts(m):
    return m.get('pdserve:request_success_total{finished_reason="abort"}', 0)


def idle_after_abort(before, n: int = 1):
    return lambda m: (aborts(m) == before + n and m["pdserve:kv_cache_usage_perc"] == 0
                      and m["pdserve:num_requests_running"] == 0 and m["pdserve:num_requests_waiting"] == 0)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Once upon a time", **LONG}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **LONG}),
    ("/generate_stream", {"prompt": "Once upon a time", "max_tokens": 1000}),
])
def test_dropped_stream_is_aborted_and_frees_kv(server, path, body):
    before = aborts(server.metrics())
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()   # (breaking out of a loop over it would already close the connection)
        events = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert len(events) == 3
        # mid-stream: the KV cache holds this request's blocks
        assert server.metrics()["pdserve:kv_cache_usage_perc"] > 0
    # leaving the block closes the connection
    server.wait_for(idle_after_abort(before), timeout=5)


def test_non_streaming_client_that_leaves_is_aborted(server):
    before = aborts(server.metrics())
    # 16 choices: a non-streamed request makes no output per step, and one choice of 1000 tokens
    # took ~0.35 s on this tiny model, too close to the client's timeout; 16 took ~0.5 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "n": 16, **LONG},
                   timeout=httpx.Timeout(30, read=0.2))
    server.wait_for(idle_after_abort(before, 16), timeout=5)
