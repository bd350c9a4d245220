"""The origin server's endpoints keep their field names and are served by the shared engine."""
import concurrent.futures as cf
import json

import httpx

PROMPTS = ["Once upon a time", "The old sailor looked at the sea and said", "Hi"]


def post(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_basic_generate_returns_the_greedy_continuation(server):
    r = post(server, "/basic_generate", {"prompt": PROMPTS[0]})
    assert list(r) == ["generated_text"]
    ref = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 64, "temperature": 0})
    assert r["generated_text"] == ref["choices"][0]["text"]   # continuation only, greedy, 64 tokens
    short = post(server, "/basic_generate", {"prompt": PROMPTS[0], "max_tokens": 5})["generated_text"]
    assert r["generated_text"].startswith(short) and len(short) < len(r["generated_text"])


def test_generate_answers_in_input_order(server):
    r = post(server, "/generate", {"prompts": PROMPTS})
    assert list(r) == ["generated_texts"]
    assert r["generated_texts"] == [post(server, "/basic_generate", {"prompt": p})["generated_text"] for p in PROMPTS]


def test_generate_stream_events(server):
    events = []
    with httpx.stream("POST", server.url + "/generate_stream", json={"prompt": PROMPTS[1]}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(json.loads(line[6:]))
    assert len(events) > 1 and all(set(e) == {"token", "sequence_id"} for e in events)
    assert len({e["sequence_id"] for e in events}) == 1
    assert "".join(e["token"] for e in events) == post(server, "/basic_generate", {"prompt": PROMPTS[1]})[
        "generated_text"]


def test_origin_and_openai_requests_share_steps(server):
    def big_steps(m):   # steps with more than two sequences
        return m["pdserve:step_num_seqs_count"] - m['pdserve:step_num_seqs_bucket{le="2.0"}']
    solo = [post(server, "/basic_generate", {"prompt": p, "max_tokens": 40})["generated_text"] for p in PROMPTS]
    before = server.metrics()
    with cf.ThreadPoolExecutor(3) as pool:
        chat = pool.submit(post, server, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "ignore_eos": True})
        gen = pool.submit(post, server, "/generate", {"prompts": PROMPTS, "max_tokens": 40})
        assert gen.result()["generated_texts"] == solo
        assert chat.result()["usage"]["completion_tokens"] == 200
    assert big_steps(server.metrics()) > big_steps(before)


def test_origin_default_stops_at_the_context_and_a_given_max_tokens_past_it_is_refused(server):
    prompt = "word " * 490
    n = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["count"]
    assert 1024 - 64 < n < 1024   # less room than the default 64 tokens
    r = post(server, "/basic_generate", {"prompt": prompt})
    ref = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1024 - n, "temperature": 0})
    assert r["generated_text"] == ref["choices"][0]["text"]
    # asked for: refused as the OpenAI endpoints refuse it, in their error format
    for path in ("/basic_generate", "/generate_stream"):
        refused = httpx.post(server.url + path, json={"prompt": prompt, "max_tokens": 64}, timeout=60)
        assert refused.status_code == 400, refused.text
        openai = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 64}, timeout=60)
        assert openai.status_code == 400
        assert refused.json()["error"]["param"] == openai.json()["error"]["param"]
