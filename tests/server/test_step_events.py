"""GET /v1/engine/steps on a real server: one event per engine step, with the fields docs/API.md
lists, consistent with what the request did (its prefill chunks, its decodes, its end)."""
import json
import signal
import threading

import httpx

STEP_KEYS = {"seq", "time", "step", "running", "waiting", "kv_cache_usage", "kv_free_blocks", "kv_total_blocks",
             "requests", "requests_omitted"}
STEP_FIELDS = {"duration_s", "forward_s", "num_seqs", "prefill_tokens", "decode_tokens", "preemptions"}
LIVE_FIELDS = {"id", "state", "step_tokens", "step_prefill", "preempted", "prompt_tokens", "computed_tokens",
               "output_tokens", "preemptions"}
FINISHED_FIELDS = {"id", "state", "finish_reason", "step_tokens", "step_prefill", "prompt_tokens", "output_tokens",
                   "preemptions", "ttft_s", "tpot_s"}


class StepStream:
    """Reads /v1/engine/steps in a thread until `until(events)` holds (or the stream ends)."""

    def __init__(self, url: str, until, history: int = 0, timeout: float = 60):
        self.config, self.events, self.ended = None, [], False
        self._until, self._ready = until, threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, history, timeout), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "no config event"

    def _read(self, url, history, timeout):
        try:
            with httpx.stream("GET", f"{url}/v1/engine/steps?history={history}", timeout=timeout) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                event = None
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        if event == "config":
                            self.config = data
                            self._ready.set()
                        elif event == "step":
                            self.events.append(data)
                            if self._until(self.events):
                                return
            self.ended = True
        finally:
            self._ready.set()

    def join(self, timeout: float = 60) -> list[dict]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the step stream did not deliver what was expected"
        return self.events


def entries(events, rid):
    return [(e, r) for e in events for r in e["requests"] if r["id"] == rid]


def finished(prefix):
    return lambda events: any(r["state"] == "finished" and r["id"].startswith(prefix)
                              for e in events for r in e["requests"] or [])


def test_one_event_per_step_with_the_request_through_its_phases(server):
    # a prompt longer than the step budget (512 tokens): its prefill is cut into chunks
    prompt = "Once upon a time there was a little robot. " * 70
    n_prompt = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["count"]
    assert 512 < n_prompt < 1000
    stream = StepStream(server.url, finished("cmpl-"))
    assert stream.config["max_num_batched_tokens"] == 512 and stream.config["max_model_len"] == 1024
    assert stream.config["ring_size"] >= 1 and stream.config["backend"] == "engine"
    assert None not in stream.config.values()   # every limit read from the engine's config
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200
    events = stream.join()
    rid = r.json()["id"] + "-0"

    seqs = [e["seq"] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))   # one per step, none skipped
    for e in events:
        assert set(e) == STEP_KEYS and set(e["step"]) == STEP_FIELDS
        assert e["step"]["duration_s"] >= e["step"]["forward_s"] > 0
        for q in e["requests"]:
            assert set(q) == (FINISHED_FIELDS if q["state"] == "finished" else LIVE_FIELDS)
        # every live request is listed (fewer than 64): the step's tokens are theirs
        assert e["requests_omitted"] == 0
        assert e["step"]["prefill_tokens"] == sum(q["step_tokens"] for q in e["requests"] if q["step_prefill"])
        assert e["step"]["decode_tokens"] == sum(q["step_tokens"] for q in e["requests"] if not q["step_prefill"])

    mine = entries(events, rid)
    prefill = [q["step_tokens"] for _, q in mine if q["step_prefill"]]
    decode = [q["step_tokens"] for _, q in mine if q["step_tokens"] and not q["step_prefill"]]
    assert len(prefill) >= 2 and max(prefill) <= 512 and sum(prefill) == n_prompt   # chunked prefill
    assert decode == [1, 1, 1]   # the first token came with the last chunk
    assert [q["state"] for _, q in mine if q["step_tokens"]][:len(prefill) - 1] == ["prefill"] * (len(prefill) - 1)
    first, last = mine[0][1], mine[-1][1]
    assert first["prompt_tokens"] == n_prompt
    assert last["state"] == "finished" and last["finish_reason"] == "length" and last["output_tokens"] == 4
    assert last["ttft_s"] > 0 and last["tpot_s"] > 0
    assert max(e["kv_cache_usage"] for e, _ in mine) > 0
    end = mine[-1][0]
    assert end["running"] == 0 and end["kv_free_blocks"] == end["kv_total_blocks"]   # its blocks are freed


def test_a_dropped_stream_shows_as_an_abort_and_history_replays_steps(server):
    stream = StepStream(server.url, finished("cmpl-"))
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        rid = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["id"] + "-0"
    events = stream.join()
    mine = entries(events, rid)
    assert mine[-1][1]["state"] == "finished" and mine[-1][1]["finish_reason"] == "abort"
    assert 1 <= mine[-1][1]["output_tokens"] < 1000
    assert any(q["state"] == "decode" for _, q in mine)
    # a new subscriber can ask for the steps it missed
    replay = StepStream(server.url, lambda ev: len(ev) >= 5, history=5)
    assert [e["seq"] for e in replay.join()] == [events[-1]["seq"] - i for i in range(4, -1, -1)]


def test_sigterm_ends_the_step_streams_and_the_server_exits_promptly(start_server, tiny_llama):
    # Without ending the streams, uvicorn would wait for them until --shutdown-timeout (+2 s).
    server = start_server(tiny_llama, "--shutdown-timeout", "120", "--num-kv-blocks", "64")
    stream = StepStream(server.url, lambda ev: False, timeout=300)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    stream.join(10)
    assert stream.ended


def test_a_preemption_is_marked_and_followed_by_a_re_prefill(start_server, tiny_llama):
    # 8 blocks of 16 tokens: two requests of 100 tokens each cannot both stay in the cache
    # (without the prefix cache, whose blocks would spare part of the re-prefill)
    server = start_server(tiny_llama, "--num-kv-blocks", "8", "--no-enable-prefix-caching")
    body = {"max_tokens": 100, "ignore_eos": True, "temperature": 0}
    stream = StepStream(server.url, lambda ev: sum(q["state"] == "finished" for e in ev for q in e["requests"]) == 2)
    with httpx.Client(timeout=120) as c:
        r = c.post(server.url + "/v1/completions", json={"prompt": ["Once upon a time", "The little dog"], **body})
    assert r.status_code == 200
    events = stream.join(120)
    rid = next(q["id"] for e in events for q in e["requests"] if q["preempted"])
    mine = entries(events, rid)
    at = next(i for i, (_, q) in enumerate(mine) if q["preempted"])
    event, q = mine[at]
    assert event["step"]["preemptions"] >= 1 and q["state"] == "waiting" and q["computed_tokens"] == 0
    generated = q["output_tokens"]
    # back in: its prompt and what it had generated are prefilled again
    redo = []
    for x in [x for _, x in mine[at + 1:] if x["step_tokens"]]:
        if not x["step_prefill"]:
            break
        redo.append(x["step_tokens"])
    assert sum(redo) == q["prompt_tokens"] + generated
    last = mine[-1][1]
    assert last["state"] == "finished" and last["output_tokens"] == 100 and last["preemptions"] >= 1
    server.stop()
