"""pdserve on a local two-node Ray cluster (one CPU per node, one engine replica on each): placement,
exactness against a single engine, KV-aware routing, a replica killed mid-request, and scaling.
One app for the whole module, on the cluster of conftest.py; the tests run in order (the kill
tests last: a replica's replacement is not waited for)."""
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (.ci/run installs it)")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]'")
httpx = pytest.importorskip("httpx")

from pdserve.cli import Parser  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.entrypoints.ray_serve import APP_NAME, deploy, scale  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.entrypoints import serve_args  # noqa: E402
from tests.helpers import finish_all  # noqa: E402

LONG = 450   # tokens of the requests a replica is killed under (the context is 512)
PROMPTS = ["Once upon a time there was a little cat", "The dog ran to the park and", "Lily and Tom went to"]


def parse(model: str, *extra: str):
    p = Parser(prog="pdserve serve")
    serve_args.add_arguments(p)
    args = p.parse_args(["--model", model, "--ray", "--num-replicas", "2", "--ray-replicas-per-node", "1",
                         "--max-model-len", "512", "--shutdown-timeout", "5", *extra])
    serve_args.resolve_model(args)
    return args


@pytest.fixture(scope="module")
def model(ray_model):
    return ray_model


@pytest.fixture(scope="module")
def url(ray_url, model):
    deploy(parse(model))
    yield ray_url
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def reference(model):
    """A single engine, as each replica is built (one thread), for the greedy tokens to compare with."""
    engine = LLMEngine(model, max_model_len=512, threads=1)

    def greedy(prompt: str, max_tokens: int) -> str:
        engine.add_request("ref", engine.tokenizer.encode(prompt),
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return finish_all(engine)["ref"].text
    return greedy


def complete(url: str, prompt: str, max_tokens: int = 8, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                     "ignore_eos": True, **extra}, timeout=120)


def replicas_running() -> int:
    return serve.status().applications[APP_NAME].deployments["EngineReplica"].replica_states.get("RUNNING", 0)


def wait_replicas(n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while replicas_running() != n or serve.status().applications[APP_NAME].status != "RUNNING":
        assert time.monotonic() < deadline, f"never {n} running replicas: {serve.status()}"
        time.sleep(0.5)


def replica_ids() -> set[str]:
    prefix = f"SERVE_REPLICA::{APP_NAME}#EngineReplica#"
    return {a["name"].removeprefix(prefix) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def kill(replica: str) -> None:
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#EngineReplica#{replica}", namespace="serve"), no_restart=True)


def test_one_replica_on_each_node(url):
    seen = {}
    for p in PROMPTS[:2]:   # two new prefixes: the router spreads them over the idle replicas
        r = complete(url, p)
        assert r.status_code == 200, r.text
        seen[r.headers["x-pdserve-replica"]] = r.headers["x-pdserve-node"]
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(seen) == 2 and set(seen.values()) == nodes and len(nodes) == 2


def test_greedy_tokens_equal_a_single_engines(url, reference):
    for p in PROMPTS:
        r = complete(url, p, 24)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(p, 24)
    # chat, streamed: the same content as the same chat unstreamed
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["content"]
    parts = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                parts.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["delta"].get("content") or "")
    assert "".join(parts) == whole and whole


def test_a_prompt_goes_to_the_replica_that_holds_its_prefix(url):
    system = "You are a helpful assistant who tells short stories about animals. " * 4
    first = complete(url, system + "Tell one about a cat.")
    home = first.headers["x-pdserve-replica"]
    for question in ("a dog.", "a bird.", "a fish."):
        complete(url, "Something else entirely: " + question * 30)   # other traffic in between
        r = complete(url, system + "Tell one about " + question)
        assert r.headers["x-pdserve-replica"] == home
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32   # its engine found it cached


def test_scaling_down_and_up_keeps_serving(url):
    statuses, stop = [], threading.Event()

    def traffic():
        i = 0
        while not stop.is_set():
            statuses.append(complete(url, f"{PROMPTS[i % 3]} {i}").status_code)
            i += 1
    t = threading.Thread(target=traffic)
    t.start()
    try:
        before = replica_ids()
        scale(1)
        wait_replicas(1)
        scale(2)
        wait_replicas(2)
    finally:
        stop.set()
        t.join(60)
    assert len(statuses) > 3 and set(statuses) == {200}
    after = replica_ids()
    assert len(before) == 2 and len(after) == 2 and len(before & after) == 1   # one served throughout, one is new


def _stream_events(url: str, prompt: str, started: threading.Event, out: dict) -> None:
    body = {"prompt": prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        out["replica"] = r.headers["x-pdserve-replica"]
        out["events"] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
                started.set()


def in_flight_together(stream: threading.Thread, request: threading.Thread, started: threading.Event,
                       streamed: dict) -> None:
    """Start the stream, then the plain request once the stream has its first token; return once the
    stream has a hundred more (far longer than Serve's proxy and router take to place the plain
    request), so the plain request, sent after the stream and as long, is surely running."""
    stream.start()
    assert started.wait(60)
    request.start()
    deadline = time.monotonic() + 60
    while len(streamed["events"]) < 100 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert request.is_alive() and len(streamed["events"]) < LONG


def test_a_killed_replicas_requests_fail_cleanly(url):
    prompt = " ".join(PROMPTS * 2) + " and then"   # blocks enough that prefix-aware routing sends it home
    home = complete(url, prompt).headers["x-pdserve-replica"]   # the prefix is there now
    started, streamed, plain = threading.Event(), {}, {}
    stream = threading.Thread(target=_stream_events, args=(url, prompt, started, streamed))
    request = threading.Thread(target=lambda: plain.update(r=complete(url, prompt, LONG)))
    in_flight_together(stream, request, started, streamed)
    assert streamed["replica"] == home
    kill(home)
    stream.join(60)
    request.join(60)
    assert streamed["events"][-1] == "[DONE]"
    error = httpx.Response(200, content=streamed["events"][-2]).json()["error"]
    assert error["code"] == "replica_failed" and len(streamed["events"]) < LONG
    r = plain["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed"
    assert complete(url, prompt).status_code == 200   # the other replica serves on


def test_with_retry_a_killed_replicas_request_is_served_by_another(url, model, reference):
    deploy(parse(model, "--ray-retry-failed"))
    wait_replicas(2)
    prompt = " ".join(PROMPTS * 2) + " by the sea"
    home = complete(url, prompt).headers["x-pdserve-replica"]
    started, streamed, plain = threading.Event(), {}, {}
    request = threading.Thread(target=lambda: plain.update(r=complete(url, prompt, LONG)))
    stream = threading.Thread(target=_stream_events, args=(url, prompt, started, streamed))
    in_flight_together(stream, request, started, streamed)
    kill(home)
    request.join(120)
    stream.join(60)
    r = plain["r"]
    assert r.status_code == 200 and r.headers["x-pdserve-replica"] != home   # retried elsewhere
    assert r.json()["choices"][0]["text"] == reference(prompt, LONG)
    assert "replica_failed" in streamed["events"][-2]   # a stream that had begun is not retried
