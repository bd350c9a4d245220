"""SIGTERM: stop admitting, let running requests finish (up to --shutdown-timeout), exit 0."""
import concurrent.futures as cf
import json
import signal
import time

import httpx


def stream_events(url: str, body: dict, started: cf.Future) -> tuple[list, bool]:
    """(events, completed): the parsed data events of a completions stream; completed = it ended cleanly."""
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    if not started.done():
                        started.set_result(True)
        return events, True
    except httpx.TransportError:   # the connection was cut
        return events, False


def tokens_in(url: str, seconds: float, low: int, high: int) -> int:
    """How many tokens this server generates in about `seconds` (within [low, high]), timed on a
    warm-up request: the streams below are sized by the machine's speed, not by a fixed count that
    a slower machine (torch's ops, a busy CPU) does not finish in time."""
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": "Warm up", "max_tokens": 32, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    per_token = (time.monotonic() - t0) / 32
    return max(low, min(high, int(seconds / per_token)))


def test_sigterm_lets_running_streams_finish_then_exits_0(start_server, make_tiny):
    # OPT: another family, and a checkpoint without a chat template. A longer context than the
    # shared tiny model's, so that one request can outlast the shutdown timeout.
    model = make_tiny("opt", max_position_embeddings=16384)
    server = start_server(model, "--shutdown-timeout", "6", "--max-num-seqs", "4")
    messages = [{"role": "user", "content": "Hello"}]
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4}).json()
    rendered = httpx.post(server.url + "/tokenize", json={"prompt": "user: Hello\nassistant:"}).json()
    assert chat["usage"]["prompt_tokens"] == rendered["count"]   # the tokenizer's plain fallback template
    n_short = tokens_in(server.url, 0.5, 8, 200)   # well within the 6 s timeout, beside two other streams
    short = {"prompt": "Once upon a time", "max_tokens": n_short, "ignore_eos": True, "temperature": 0,
             "stream_options": {"include_usage": True}}
    endless = {"prompt": "Far away", "max_tokens": 16000, "ignore_eos": True}   # far longer than the timeout
    with cf.ThreadPoolExecutor(3) as pool:
        started = [cf.Future(), cf.Future()]
        b = pool.submit(stream_events, server.url, endless, started[1])
        c = pool.submit(httpx.post, server.url + "/v1/completions", json=endless, timeout=60)
        server.wait_for(lambda m: m["pdserve:num_requests_running"] == 2)
        a = pool.submit(stream_events, server.url, short, started[0])
        cf.wait(started, timeout=30)
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        # no longer admitting: either 503 (before the listener closes) or no connection at all;
        # the busy server may take a moment to handle the signal: /health says when it has
        try:
            while httpx.get(server.url + "/health", timeout=5).status_code == 200:
                time.sleep(0.01)
            assert httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"}, timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        events, completed = a.result()
        assert completed and events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == n_short
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        # ended when the timeout expired, and told why: the error event, then [DONE]
        cut_events, cut_completed = b.result()
        assert cut_completed and cut_events[-1] == "[DONE]"
        assert cut_events[-2]["error"]["code"] == "shutdown_timeout"
        assert 0 < len(cut_events) - 2 < 16000
        assert not any(e["choices"][0]["finish_reason"] for e in cut_events[:-2])
        # a plain (non-streamed) request that outlasts the timeout gets the same error as a response
        r = c.result()
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutdown_timeout"
    assert server.proc.wait(30) == 0
    assert 5.5 < time.monotonic() - t0 < 30   # waited for the timeout, then ended the endless ones


def test_sigterm_under_load_finishes_every_admitted_stream(start_server, tiny_llama):
    # six streams against four seats: two still wait in the engine's queue when SIGTERM arrives
    server = start_server(tiny_llama, "--shutdown-timeout", "120", "--max-num-seqs", "4")
    # long enough (a few seconds) that all six are still in flight when the signal lands
    n = tokens_in(server.url, 3.0, 50, 900)
    body = {"max_tokens": n, "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    with cf.ThreadPoolExecutor(6) as pool:
        started = [cf.Future() for _ in range(6)]
        streams = [pool.submit(stream_events, server.url, {**body, "prompt": f"Story {i}:"}, started[i])
                   for i in range(6)]
        deadline = time.monotonic() + 30   # any four are generating (arrival order is not submission order)
        while sum(f.done() for f in started) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(f.done() for f in started) == 4
        server.wait_for(lambda m: m["pdserve:num_requests_running"] + m["pdserve:num_requests_waiting"] == 6)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:   # refused: 503 while the listener is still open, no connection once it closed
            # the busy server may take a moment to handle the signal: /health says when it has
            while httpx.get(server.url + "/health", timeout=5).status_code == 200:
                time.sleep(0.01)
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"}, timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        except httpx.TransportError:
            pass
        for f in streams:
            events, completed = f.result()
            assert completed and events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == n
            assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(120) == 0
    assert time.monotonic() - t0 < 60   # left as soon as the streams were done (about 6 s), not at the timeout
