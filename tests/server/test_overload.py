"""Overload: many times more requests than the server completes, against a small --max-waiting.
Past the cap requests get 503 + Retry-After, /health keeps answering 200, and every admitted
request completes. Behaviour only: the latencies are measured by benchmarks/overload.py."""
import asyncio
import json

import httpx
import pytest

MAX_TOKENS = 12
CLIENTS = 60          # against 2 running + 4 waiting seats: 10x what the server holds
ATTEMPTS = 3          # requests per client, one after the other


@pytest.fixture(scope="module")
def small(start_server, tiny_llama):
    return start_server(tiny_llama, "--max-waiting", "4", "--max-num-seqs", "2", "--log-level", "warning")


async def one_request(client: httpx.AsyncClient, i: int) -> tuple[int, dict]:
    """(status, what it got): the final choice and usage if admitted, the error and headers if not."""
    body = {"prompt": f"Request {i} says", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    if i % 2:   # half of them streamed: admitted = 200 headers, completed = a finish_reason then [DONE]
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}}) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, {"error": r.json()["error"], "retry_after": r.headers.get("Retry-After")}
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        finals = [json.loads(e)["choices"][0] for e in events[:-2] if json.loads(e)["choices"][0]["finish_reason"]]
        return 200, {"finish": [c["finish_reason"] for c in finals], "done": events[-1] == "[DONE]",
                     "usage": json.loads(events[-2])["usage"]}
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        return r.status_code, {"error": r.json()["error"], "retry_after": r.headers.get("Retry-After")}
    return 200, {"finish": [c["finish_reason"] for c in r.json()["choices"]], "done": True, "usage": r.json()["usage"]}


async def offer(url: str):
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=CLIENTS + 10)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        stop, health = asyncio.Event(), []

        async def probe():
            while not stop.is_set():
                health.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.05)

        async def user(u):
            return [await one_request(client, u * ATTEMPTS + k) for k in range(ATTEMPTS)]
        prober = asyncio.create_task(probe())
        results = [r for rs in await asyncio.gather(*(user(u) for u in range(CLIENTS))) for r in rs]
        stop.set()
        await prober
        return results, health


def test_overload_refuses_fast_and_completes_every_admitted(small):
    before = small.metrics()
    results, health = asyncio.run(offer(small.url))
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 503}, sorted(set(statuses))   # no other 5xx, no 4xx
    admitted = [r for s, r in results if s == 200]
    refused = [r for s, r in results if s == 503]
    assert admitted and refused, (len(admitted), len(refused))
    for r in refused:
        assert r["retry_after"] == "1" and r["error"]["code"] == "queue_full" and r["error"]["type"] == "server_error"
    for r in admitted:   # every admitted request completed in full
        assert r["done"] and r["finish"] == ["length"] and r["usage"]["completion_tokens"] == MAX_TOKENS
    assert health and set(health) == {200}
    after = small.wait_for(lambda m: m["pdserve:num_requests_running"] == 0 and m["pdserve:num_requests_waiting"] == 0
                           and m["pdserve:kv_cache_usage_perc"] == 0)
    key = 'pdserve:request_success_total{finished_reason="length"}'
    assert after[key] - before.get(key, 0) == len(admitted)
