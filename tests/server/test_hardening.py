"""Defences against hostile or careless clients, on the fake engine: text that is not Unicode,
bodies that are not JSON, foreign Host headers, CORS, the Authorization header, request cost,
the work done before admission, and 500s that keep the connection. Slow clients and the
connection cap are in test_connections.py."""
import asyncio
import json
import socket
import threading

import pytest
from fastapi.testclient import TestClient

from pdserve.server import openai_api
from pdserve.server.app import build_app
from pdserve.server.admission import OFFLOAD_CHARS
from pdserve.server.config import ServerConfig
from tests.server.fake_engine import FakeEngine, FakePagedEngine, FakeTokenizer
from tests.server.test_connections import running_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# (path, a body whose text fields all carry a lone surrogate, the param named)
SURROGATE_BODIES = [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "ok", "model": "\\udfff"}', "model"),
    ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud83d"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "model": "\\ud800"}', "model"),
    ("/basic_generate", '{"prompt": "\\ud800"}', "prompt"),
    ("/generate", '{"prompts": ["ok", "\\udc00"]}', "prompts"),
    ("/generate_stream", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800x"}]}', "messages"),
    ("/detokenize", '{"tokens": [1], "\\ud800": 1}', "\ud800".encode("utf-8", "backslashreplace").decode()),
]


def client(engine=None, **config) -> TestClient:
    return TestClient(build_app(engine or FakeEngine(), ServerConfig(served_model_name="fake-model", **config)))


def post_raw(sock: socket.socket, path: str, body: str, content_type: str = "application/json") -> tuple[int, dict]:
    """One request on an open keep-alive socket; (status, JSON body)."""
    data = body.encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, dict]:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        head += chunk
    head, rest = head.split(b"\r\n\r\n", 1)
    length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split()[1]), json.loads(rest)


def test_lone_surrogates_get_400_naming_the_field_and_keep_the_connection():
    with running_app(FakeEngine()) as (host, port), socket.create_connection((host, port)) as sock:
        for path, body, param in SURROGATE_BODIES:
            status, answer = post_raw(sock, path, body)   # all on one keep-alive connection
            assert status == 400, (path, answer)
            assert answer["error"]["param"] == param and answer["error"]["code"] == "invalid_unicode", answer
        # valid pairs are text: an emoji passes
        status, answer = post_raw(sock, "/tokenize", '{"prompt": "\\ud83d\\ude00"}')
        assert status == 200 and answer["count"] == 1


def test_bytes_that_are_not_utf8_get_400_and_keep_the_connection():
    # json.loads(bytes) decodes with surrogatepass: these (CESU-8 for \ud800, a stray 0xff) would
    # reach the tokenizer as a str it cannot take
    with running_app(FakeEngine()) as (host, port), socket.create_connection((host, port)) as sock:
        for raw in (b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', b'{"prompt": "a\xffb", "max_tokens": 2}'):
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
            status, answer = read_response(sock)
            assert status == 400 and answer["error"]["code"] == "invalid_unicode", answer
            assert "UTF-8" in answer["error"]["message"]
        status, answer = post_raw(sock, "/tokenize", '{"prompt": "ok"}')   # the same connection
        assert status == 200


def test_a_post_without_body_or_content_type_passes_and_one_with_a_body_does_not():
    engine = FakePagedEngine()
    with client(engine) as c:
        r = c.post("/reset_prefix_cache")   # what vLLM's clients send: no body, no content type
        assert r.status_code == 200 and engine.resets == 1, r.text
        r = c.post("/reset_prefix_cache", content=b"{}")
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = c.post("/v1/completions")   # no body where one is required: a 400, not a 500
        assert r.status_code == 400, r.text


def test_the_largest_seed_works_with_n_and_a_larger_one_is_named_as_sent():
    with client() as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2, "seed": 2**64 - 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2, "seed": 2**64})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
        assert str(2**64) in r.json()["error"]["message"] and str(2**64 + 1) not in r.json()["error"]["message"]


class _BrokenTokenizer(FakeTokenizer):
    def encode(self, text, add_special_tokens=True):
        if "boom" in text:
            raise RuntimeError("a bug")
        return super().encode(text, add_special_tokens)


def test_a_500_keeps_the_keep_alive_connection():
    engine = FakeEngine()
    engine.tokenizer = _BrokenTokenizer()
    with running_app(engine) as (host, port), socket.create_connection((host, port)) as sock:
        status, answer = post_raw(sock, "/v1/completions", '{"prompt": "boom", "max_tokens": 2}')
        assert status == 500 and answer["error"]["type"] == "server_error" and "a bug" in answer["error"]["message"]
        status, answer = post_raw(sock, "/v1/completions", '{"prompt": "ok", "max_tokens": 2}')   # same socket
        assert status == 200 and answer["choices"][0]["text"] == "ab"


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain", "multipart/form-data"])
def test_a_body_that_is_not_declared_json_gets_415(content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    with client() as c:
        for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"):
            r = c.post(path, content=json.dumps({"prompt": "x", **CHAT}), headers=headers)
            assert r.status_code == 415, (path, r.text)
            assert r.json()["error"]["code"] == "unsupported_media_type"
        ok = c.post("/tokenize", content='{"prompt": "x"}', headers={"Content-Type": "Application/JSON; charset=utf-8"})
        assert ok.status_code == 200


def test_host_header_is_checked_against_allowed_hosts():
    with client(allowed_hosts=["127.0.0.1", "localhost", "::1"]) as c:
        for host in ("127.0.0.1:8000", "localhost", "[::1]:8000", "LOCALHOST:1"):
            assert c.get("/health", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "testserver"):
            r = c.get("/v1/models", headers={"Host": host})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
    with client() as c:   # None: any (the launcher's default for a 0.0.0.0 bind)
        assert c.get("/health", headers={"Host": "anything"}).status_code == 200


def test_cors_is_off_by_default_and_follows_the_flags():
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    with client() as c:
        r = c.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = c.post("/tokenize", json={"prompt": "x"}, headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in r.headers
    with client(allowed_origins=["https://app.example"], api_key="k") as c:
        r = c.options("/v1/completions", headers=preflight)   # a preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.post("/tokenize", json={"prompt": "x"}, headers={"Origin": "https://app.example",
                                                               "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.options("/v1/completions", headers={**preflight, "Origin": "https://other.example"})
        assert r.status_code == 400


def test_authorization_scheme_is_case_insensitive_and_duplicates_are_refused():
    with client(api_key="k") as c:
        for value in ("Bearer k", "bearer k", "BEARER k"):
            assert c.get("/v1/models", headers={"Authorization": value}).status_code == 200, value
        for value in ("Basic k", "Bearer", "k", "Bearerk"):
            assert c.get("/v1/models", headers={"Authorization": value}).status_code == 401, value
        two = [("Authorization", "Bearer wrong"), ("Authorization", "Bearer k")]
        r = c.get("/v1/models", headers=two)
        assert r.status_code == 400 and "one Authorization header" in r.json()["error"]["message"]
        r = c.get("/v1/models", headers=list(reversed(two)))
        assert r.status_code == 400


INT_FIELDS = [("/v1/completions", {"prompt": "x"}, f) for f in ("n", "max_tokens", "top_k", "seed", "min_tokens",
                                                                 "logprobs")] + \
    [("/v1/chat/completions", CHAT, f) for f in ("max_completion_tokens", "top_logprobs")] + \
    [("/basic_generate", {"prompt": "x"}, "max_tokens")]


@pytest.mark.parametrize("path,body,field", INT_FIELDS, ids=[f"{p} {f}" for p, _, f in INT_FIELDS])
def test_booleans_strings_and_floats_are_not_integers(path, body, field):
    with client() as c:
        for value in (True, "2", 2.0):
            r = c.post(path, json={**body, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (value, r.text)
    with client() as c:   # and lists of integers
        r = c.post("/v1/completions", json={"prompt": [1, True]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = c.post("/detokenize", json={"tokens": [1, False]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_small_ones_name_the_right_field():
    with client(max_waiting=256) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        r = c.post("/generate", json={"prompts": ["x"] * 300})   # 256 waiting + 4 seats
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompts", r.text


def test_one_request_cannot_ask_for_more_than_max_request_cost():
    engine = FakeEngine(max_model_len=4096)
    with client(engine, max_request_cost=1000, max_n=64) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "n": 10, "max_tokens": 20, "logprobs": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert "1200" in r.json()["error"]["message"] and "--max-request-cost" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": ["x", "y"], "n": 10, "max_tokens": 60})   # 2 x 10 x 60
        assert r.status_code == 400
        r = c.post("/v1/completions", json={"prompt": "x", "n": 10, "max_tokens": 20, "logprobs": 4})   # = 1000
        assert r.status_code == 200 and len(r.json()["choices"]) == 10
        # chat's default (the rest of the context) is lowered to fit instead of refused
        r = c.post("/v1/chat/completions", json={"messages": CHAT["messages"], "n": 4, "logprobs": True,
                                                 "top_logprobs": 4})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 4 * (1000 // (4 * 5))


class _CountingTokenizer(FakeTokenizer):
    def __init__(self):
        self.threads = []

    def encode(self, text, add_special_tokens=True):
        self.threads.append(threading.current_thread())
        return super().encode(text, add_special_tokens)


def test_nothing_is_tokenized_for_a_request_that_is_refused_anyway():
    engine = FakeEngine(max_model_len=64)
    engine.tokenizer = tok = _CountingTokenizer()
    with client(engine, max_prompt_tokens=50) as c:
        s = c.app.state.pdserve
        # longer than any text of 50 tokens can be (FakeTokenizer: one character per token)
        for path, body, param in [("/v1/completions", {"prompt": "x" * 51}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 51}]},
                                   "messages"),
                                  ("/generate", {"prompts": ["x", "x" * 51]}, "prompts"),
                                  ("/tokenize", {"prompt": "x" * 51}, "prompt")]:
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "characters" in r.json()["error"]["message"]
        assert tok.threads == []
        # a full queue is refused before the prompt is read
        with s.async_engine._lock:
            s.async_engine._num_posted += 1000
        r = c.post("/v1/completions", json={"prompt": "y" * 40})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        assert tok.threads == []


def test_long_prompts_are_tokenized_and_big_responses_built_off_the_event_loop(monkeypatch):
    engine = FakeEngine(max_model_len=3 * OFFLOAD_CHARS)
    engine.tokenizer = tok = _CountingTokenizer()
    built_on = []
    real = openai_api.completion_logprobs

    def spy(*args):
        built_on.append(threading.current_thread())
        return real(*args)
    monkeypatch.setattr(openai_api, "completion_logprobs", spy)
    with client(engine) as c:
        loop_thread = c.portal.call(threading.current_thread)
        assert c.post("/tokenize", json={"prompt": "short"}).status_code == 200
        assert tok.threads[-1] is loop_thread   # a short one is not worth the hop
        r = c.post("/v1/completions", json={"prompt": "x" * (OFFLOAD_CHARS + 1), "max_tokens": 1})
        assert r.status_code == 200 and tok.threads[-1] is not loop_thread
        assert tok.threads[-1].name.startswith("pdserve-cpu")
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "n": 4, "logprobs": 5})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 200
        assert built_on and all(t.name.startswith("pdserve-cpu") for t in built_on)


def test_as_many_clients_as_seats_are_never_refused():
    """--max-waiting 0 and 4 seats: 4 clients in a closed loop always find a seat."""
    statuses = []

    async def clients(base_url: str):
        import httpx
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            async def one_client():
                for _ in range(15):
                    r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
                    statuses.append(r.status_code)
            await asyncio.gather(*(one_client() for _ in range(4)))
    with running_app(FakeEngine(max_num_seqs=4), max_waiting=0) as (host, port):
        asyncio.run(clients(f"http://{host}:{port}"))
    assert statuses == [200] * 60, sorted(set(statuses))


def test_metrics_carry_model_name_and_no_created_series():
    with client() as c:
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        text = c.get("/metrics").text
    series = [line for line in text.splitlines() if line.startswith("pdserve:")]
    assert series and all('model_name="fake-model"' in line for line in series), \
        [line for line in series if "model_name" not in line][:3]
    assert "_created" not in text
    assert 'pdserve:request_success_total{finished_reason="length",model_name="fake-model"} 1.0' in text or \
        'pdserve:request_success_total{model_name="fake-model",finished_reason="length"} 1.0' in text
