"""Prefill/decode pools on the local two-node Ray cluster of conftest.py (one CPU per node): one
prefill replica and one decode replica, so Ray places them on different nodes and the KV moves
between them over TCP. Exactness against a colocated engine, the KV really pulled, refusals, a
client that leaves, and a killed decode or prefill replica. One app for the module; the tests run
in order (the kill tests last)."""
import os
import re
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (.ci/run installs it)")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]'")
httpx = pytest.importorskip("httpx")

from pdserve.cli import Parser  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.entrypoints.ray_serve import APP_NAME, POOLS, deploy  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.entrypoints import serve_args  # noqa: E402
from tests.helpers import finish_all  # noqa: E402

LONG = 450   # tokens of the streams a decode replica is killed under (the context is 512)
PROMPTS = ["Once upon a time there was a little cat", "The dog ran to the park and", "Lily and Tom went to"]
STORY = "The little girl walked along the river and looked at the birds in the trees. "
PREFILL_LEN = 480   # prompt tokens of the requests a prefill replica is killed under


def parse(model: str, *extra: str):
    p = Parser(prog="pdserve serve")
    serve_args.add_arguments(p)
    args = p.parse_args(["--model", model, "--ray", "--prefill-replicas", "1", "--decode-replicas", "1",
                         "--max-model-len", "512", "--max-num-batched-tokens", "16", "--shutdown-timeout", "5",
                         *extra])
    serve_args.resolve_model(args)
    serve_args.check_ray_flags(args)
    return args


@pytest.fixture(scope="module")
def url(ray_url, ray_model):
    deploy(parse(ray_model))
    yield ray_url
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def reference(ray_model):
    """A single colocated engine, as each replica is built (one thread): greedy(ids, n) -> text."""
    engine = LLMEngine(ray_model, max_model_len=512, threads=1)

    def greedy(ids: list[int], max_tokens: int) -> str:
        engine.add_request("ref", ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return finish_all(engine)["ref"].text
    greedy.tokenizer = engine.tokenizer
    return greedy


def complete(url: str, prompt: str, max_tokens: int = 8, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                     "ignore_eos": True, **extra}, timeout=120)


def streamed_text(url: str, path: str, body: dict, field) -> str:
    parts = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                parts.append(field(httpx.Response(200, content=line[6:]).json()["choices"][0]) or "")
    return "".join(parts)


def kv_metrics(url: str) -> dict[str, float]:
    """The decode replica's KV transfer counters (the ingress forwards /metrics to the decode pool)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^pdserve:(kv_transfer\w*_total)\{[^}]*\} (\S+)$", text, re.M)}


def pool_info(role: str) -> dict:
    return serve.get_deployment_handle(POOLS[role], APP_NAME).info.remote().result()


def wait_running(role: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        app = serve.status().applications[APP_NAME]
        if app.status == "RUNNING" and app.deployments[POOLS[role]].replica_states.get("RUNNING", 0) == 1:
            return
        assert time.monotonic() < deadline, f"no running {role} replica: {serve.status()}"
        time.sleep(0.5)


def test_the_pools_are_on_different_nodes_and_the_kv_moves_over_tcp(url):
    before = kv_metrics(url)
    r = complete(url, PROMPTS[0] + " " + STORY)
    assert r.status_code == 200, r.text
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {r.headers["x-pdserve-prefill-node"], r.headers["x-pdserve-node"]} == nodes and len(nodes) == 2
    prefill, decode = pool_info("prefill"), pool_info("decode")
    assert prefill["kv_transfer"]["role"] == "prefill" and decode["kv_transfer"]["role"] == "decode"
    assert prefill["kv_transfer"]["transport"] == "tcp"
    assert prefill["kv_transfer"]["kv_host"] == ray.util.get_node_ip_address()   # the node's, not loopback
    after = kv_metrics(url)
    # the decode replica pulled the prompt's KV (a recompute would count a failure, not a transfer)
    assert after["kv_transfers_total"] == before.get("kv_transfers_total", 0) + 1
    assert after["kv_transfer_failures_total"] == before.get("kv_transfer_failures_total", 0)
    assert after["kv_transfer_bytes_total"] > before.get("kv_transfer_bytes_total", 0)


def test_greedy_tokens_equal_a_colocated_engines(url, reference):
    before = kv_metrics(url)["kv_transfers_total"]
    for p in PROMPTS:
        r = complete(url, p, 24)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(reference.tokenizer.encode(p), 24)
    body = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    assert streamed_text(url, "/v1/completions", body, lambda c: c.get("text")) == reference(
        reference.tokenizer.encode(PROMPTS[1]), 16)
    messages = [{"role": "user", "content": PROMPTS[2]}]
    want = reference(reference.tokenizer.encode_chat(messages, add_generation_prompt=True), 12)
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    assert streamed_text(url, "/v1/chat/completions", body, lambda c: c["delta"].get("content")) == want
    assert kv_metrics(url)["kv_transfers_total"] == before + 6   # every one of them prefilled remotely


def test_refusals_reach_the_client_in_openai_format(url):
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": -1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"   # the prefill replica's own 400
    assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    # refused by the decode replica only (the prefill call asks for 1 token): the ingress releases
    # the lease the prefill replica made for the decode pool, long before --kv-lease-s
    r = complete(url, PROMPTS[0], 100_000)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    deadline = time.monotonic() + 120
    while pool_info("prefill")["kv_leases"]:
        assert time.monotonic() < deadline, "the lease of the refused decode call was not released"
        time.sleep(0.1)


def finished(url: str) -> dict[str, float]:
    """The decode replica's finished requests by finish reason."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = r'^pdserve:request_success_total\{.*finished_reason="(\w+)".*\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}


def test_a_client_that_leaves_aborts_its_request_on_the_decode_replica(url):
    before = finished(url)
    body = {"prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: {")
            if events == 3:
                break   # leave mid-stream
    # the ingress cancels its call, the replica aborts the request (counted after its next step)
    deadline = time.monotonic() + 60
    while (now := finished(url)).get("abort", 0) == before.get("abort", 0):
        assert time.monotonic() < deadline, f"the request was not aborted: {before} then {now}"
        time.sleep(0.2)
    assert pool_info("decode")["requests"] == 0
    assert now.get("length") == before.get("length")   # it did not run to its end


def test_a_killed_decode_replicas_requests_fail_cleanly(url):
    started, streamed, plain = threading.Event(), {"events": []}, {}

    def stream():
        body = {"prompt": PROMPTS[1], "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    streamed["events"].append(line[6:])
                    started.set()
    threads = [threading.Thread(target=stream),
               threading.Thread(target=lambda: plain.update(r=complete(url, PROMPTS[2], LONG)))]
    for t in threads:
        t.start()
    assert started.wait(60)
    deadline = time.monotonic() + 60
    while (info := pool_info("decode"))["requests"] < 2:   # both generating
        assert time.monotonic() < deadline, "the decode replica never had both requests"
        time.sleep(0.01)
    pid = info["pid"]
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert streamed["events"][-1] == "[DONE]" and len(streamed["events"]) < LONG
    assert httpx.Response(200, content=streamed["events"][-2]).json()["error"]["code"] == "replica_failed"
    r = plain["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed"
    wait_running("decode")   # Serve replaces it; the pools serve on
    assert complete(url, PROMPTS[0]).status_code == 200 and pool_info("decode")["pid"] != pid


def test_a_killed_prefill_replicas_requests_fail_cleanly(url, reference):
    # distinct long prompts (token ids): the prefill replica works through them 16 tokens a step
    prompts = [reference.tokenizer.encode(f"{i} {STORY * 40}")[:PREFILL_LEN] for i in range(3)]
    results = [None] * len(prompts)

    def send(i):
        results[i] = complete(url, prompts[i], 4, stream=(i == 0))
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while (info := pool_info("prefill"))["requests"] == 0:
        assert time.monotonic() < deadline, "the prefill replica never got the requests"
        time.sleep(0.01)
    os.kill(info["pid"], signal.SIGKILL)   # with the prompts still being prefilled
    for t in threads:
        t.join(120)
    failed = [r for r in results if r.status_code != 200]
    assert failed, "every prefill had finished before the kill: the test did not test it"
    for r in failed:   # not begun, so a JSON error even for the stream
        assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed"
    for i, r in enumerate(results):   # one whose prefill had finished is served (its KV recomputed if lost)
        if r.status_code == 200 and i > 0:
            assert r.json()["choices"][0]["text"] == reference(prompts[i], 4)
