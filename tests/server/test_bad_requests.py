"""Every bad request gets 400/404/413 in OpenAI's error format naming the field, and the
server keeps serving afterwards."""
import httpx
import pytest

OK = {"prompt": "Hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (name, path, raw body or JSON, expected status, expected param)
CASES = [
    ("invalid JSON", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("body is not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("prompt of wrong type", "/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("prompt list of mixed types", "/v1/completions", {"prompt": ["a", 1]}, 400, "prompt"),
    ("max_tokens not an int", "/v1/completions", {**OK, "max_tokens": "many"}, 400, "max_tokens"),
    ("max_tokens fractional", "/v1/completions", {**OK, "max_tokens": 2.5}, 400, "max_tokens"),
    ("temperature not a number", "/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("stream not a bool", "/v1/completions", {**OK, "stream": "sometimes"}, 400, "stream"),
    ("negative max_tokens", "/v1/completions", {**OK, "max_tokens": -5}, 400, "max_tokens"),
    ("zero max_tokens", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {**OK, "max_tokens": 10**9}, 400, "max_tokens"),
    ("huge max_completion_tokens", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 5000}, 400,
     "max_tokens"),
    ("temperature < 0", "/v1/completions", {**OK, "temperature": -0.1}, 400, "temperature"),
    ("top_p = 0", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p"),
    ("top_k < -1", "/v1/completions", {**OK, "top_k": -3}, 400, "top_k"),
    ("min_p > 1", "/v1/completions", {**OK, "min_p": 2}, 400, "min_p"),
    ("presence_penalty > 2", "/v1/completions", {**OK, "presence_penalty": 3}, 400, "presence_penalty"),
    ("repetition_penalty = 0", "/v1/completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_tokens > max_tokens", "/v1/completions", {**OK, "min_tokens": 5}, 400, "min_tokens"),
    ("logprobs > 20", "/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("n = 0", "/v1/completions", {**OK, "n": 0}, 400, "n"),
    ("n > 64", "/v1/completions", {**OK, "n": 65}, 400, "n"),
    ("prompts x n over --max-waiting + seats", "/v1/completions", {**OK, "prompt": ["a"] * 6, "n": 64}, 400, "n"),
    ("empty stop string", "/v1/completions", {**OK, "stop": [""]}, 400, "stop"),
    ("too many stop strings", "/v1/completions", {**OK, "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("negative stop token id", "/v1/completions", {**OK, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("empty prompt", "/v1/completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {**OK, "prompt": []}, 400, "prompt"),
    ("empty token list in a batch", "/v1/completions", {**OK, "prompt": [[1, 2], []]}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {**OK, "prompt": [5, 999999]}, 400, "prompt"),
    ("prompt over the context", "/v1/completions", {**OK, "prompt": "word " * 1500}, 400, "prompt"),
    ("prompt + max_tokens over the context", "/v1/completions", {**OK, "prompt": "word " * 300, "max_tokens": 900},
     400, "max_tokens"),
    ("prompt_logprobs > 20", "/v1/completions", {**OK, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("max_tokens 0 without echo", "/v1/completions", {**OK, "max_tokens": 0, "logprobs": 1}, 400, "max_tokens"),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-17"}, 404, "model"),
    ("unknown model (chat)", "/v1/chat/completions", {**CHAT, "model": "gpt-17"}, 404, "model"),
    ("origin: missing prompt", "/basic_generate", {"text": "x"}, 400, "prompt"),
    ("origin: prompts not a list", "/generate", {"prompts": "x"}, 400, "prompts"),
    ("origin: empty prompt", "/generate_stream", {"prompt": ""}, 400, "prompt"),
    ("origin: negative max_tokens", "/basic_generate", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("origin: temperature < 0", "/generate", {"prompts": ["x"], "temperature": -2}, 400, "temperature"),
    ("tokenize: neither prompt nor messages", "/tokenize", {}, 400, "prompt"),
    ("detokenize: id outside the vocabulary", "/detokenize", {"tokens": [1, -4]}, 400, "tokens"),
]


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, name, path, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    else:
        r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if param is not None:
        assert param in error["message"] or name.startswith(("unknown model", "token id", "prompt over")), error
    if name == "unknown model":
        assert error["code"] == "model_not_found"
    if name == "prompt + max_tokens over the context":
        assert "900" in error["message"] and "1024" in error["message"]   # the numbers


def test_oversized_body_gets_413(server):
    big = {"prompt": "x" * ((1 << 20) + 1)}   # over the default 1 MiB
    r = httpx.post(server.url + "/v1/completions", json=big, timeout=30)
    assert r.status_code == 413
    assert "1048576" in r.json()["error"]["message"]


def test_unknown_route_and_method_use_the_error_format(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_server_keeps_serving_after_bad_requests(server):
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + "/v1/completions", json=OK, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
