"""Caps that stop abuse, each a launch flag: over the cap is a 400 in OpenAI's format naming the
field, at the cap is served. Also: the API key is compared in constant time, and the server
listens on loopback unless told otherwise."""
import argparse
import socket

import httpx
import pytest

from pdserve.entrypoints import serve_args
from pdserve.server import middleware
from pdserve.server.config import ServerConfig

FLAGS = ["--max-prompt-tokens", "40", "--max-tokens-cap", "20", "--max-n", "2", "--max-logprobs", "3",
         "--max-stop-strings", "2", "--max-stop-length", "5", "--max-body-bytes", "4000"]
OK = {"prompt": "Hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def capped(start_server, tiny_llama):
    return start_server(tiny_llama, *FLAGS)


# (name, path, body, param, the flag the message names)
OVER = [
    ("prompt tokens", "/v1/completions", {**OK, "prompt": list(range(5, 46))}, "prompt", "--max-prompt-tokens"),
    ("chat prompt tokens", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "word " * 60}]},
     "messages", "--max-prompt-tokens"),
    ("origin prompt tokens", "/generate", {"prompts": ["Hi", "word " * 60]}, "prompts", "--max-prompt-tokens"),
    ("max_tokens", "/v1/completions", {**OK, "max_tokens": 21}, "max_tokens", "--max-tokens-cap"),
    ("max_completion_tokens", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 21}, "max_tokens",
     "--max-tokens-cap"),
    ("origin max_tokens", "/basic_generate", {"prompt": "Hi", "max_tokens": 21}, "max_tokens", "--max-tokens-cap"),
    ("n", "/v1/completions", {**OK, "n": 3}, "n", "--max-n"),
    ("chat n", "/v1/chat/completions", {**CHAT, "n": 3}, "n", "--max-n"),
    ("logprobs", "/v1/completions", {**OK, "logprobs": 4}, "logprobs", "--max-logprobs"),
    ("top_logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 4}, "top_logprobs",
     "--max-logprobs"),
    ("stop strings", "/v1/completions", {**OK, "stop": ["a", "b", "c"]}, "stop", "stop strings"),
    ("stop length", "/v1/chat/completions", {**CHAT, "stop": "abcdef"}, "stop", "--max-stop-length"),
]


@pytest.mark.parametrize("name,path,body,param,flag", OVER, ids=[c[0] for c in OVER])
def test_over_the_cap_is_a_400_naming_the_field(capped, name, path, body, param, flag):
    r = httpx.post(capped.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and flag in error["message"]


def test_at_the_cap_is_served(capped):
    r = httpx.post(capped.url + "/v1/completions", timeout=60, json={
        "prompt": list(range(5, 45)), "max_tokens": 20, "n": 2, "logprobs": 3, "stop": ["zzzzz", "qqqqq"],
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    assert r.json()["usage"] == {"prompt_tokens": 40, "completion_tokens": 40, "total_tokens": 80,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    assert httpx.post(capped.url + "/v1/completions", json={"prompt": "x" * 4001}).status_code == 413


def test_defaults_are_lowered_to_the_cap(capped):
    # chat's default (the rest of the context) and the origin's 64 become --max-tokens-cap
    chat = httpx.post(capped.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == 20 and chat["choices"][0]["finish_reason"] == "length"
    r = httpx.post(capped.url + "/basic_generate", json={"prompt": "Hi"}, timeout=60)
    assert r.status_code == 200 and r.json()["generated_text"]


def test_every_cap_is_a_flag_with_a_default():
    parser = argparse.ArgumentParser()
    serve_args.add_arguments(parser)
    args = parser.parse_args([])
    config = ServerConfig.from_args(args, "m")
    assert (args.host, config.max_prompt_tokens, config.max_tokens_cap, config.max_n, config.max_logprobs,
            config.max_stop_strings, config.max_stop_length, config.max_body_bytes, config.request_timeout) == \
        ("127.0.0.1", None, None, 64, 20, 16, 256, 1 << 20, None)
    config = ServerConfig.from_args(parser.parse_args(FLAGS + ["--request-timeout", "2.5"]), "m")
    assert (config.max_prompt_tokens, config.max_tokens_cap, config.max_n, config.max_logprobs,
            config.max_stop_strings, config.max_stop_length, config.max_body_bytes, config.request_timeout) == \
        (40, 20, 2, 3, 2, 5, 4000, 2.5)
    assert ServerConfig("m", allowed_hosts=["127.0.0.1", "localhost", "::1"]) == \
        ServerConfig.from_args(parser.parse_args([]), "m")
    assert ServerConfig.from_args(parser.parse_args(["--host", "0.0.0.0"]), "m").allowed_hosts is None
    assert ServerConfig.from_args(parser.parse_args(["--allowed-hosts", "*"]), "m").allowed_hosts is None
    assert ServerConfig.from_args(parser.parse_args(["--allowed-hosts", "a.example"]), "m").allowed_hosts == \
        ["a.example"]
    for bad in (["--max-n", "0"], ["--max-logprobs", "21"], ["--request-timeout", "0"], ["--max-body-bytes", "-1"],
                ["--max-waiting", "-1"], ["--port", "70000"], ["--shutdown-timeout", "-1"], ["--header-timeout", "0"],
                ["--max-connections", "0"], ["--max-request-cost", "0"], ["--max-model-len", "0"],
                ["--request-timeout", "nan"], ["--batch-size", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = middleware.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)
    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    from tests.server.test_app_units import app_client
    with app_client(api_key="k3y") as c:
        assert c.get("/v1/models", headers={"Authorization": "Bearer k3"}).status_code == 401   # a prefix
        assert c.get("/v1/models", headers={"Authorization": "Bearer k3y"}).status_code == 200
    assert calls == [(b"k3", b"k3y"), (b"k3y", b"k3y")]


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))   # no packet is sent: this only picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_the_default_bind_is_loopback_only(capped):
    # `capped` was started without --host
    assert httpx.get(capped.url + "/health").status_code == 200
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback interface")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{addr}:{capped.port}/health", timeout=5)
