"""Grammar work is bounded per request (issue 38): a schema too complex for the per-step limits
is a 400 before admission, one that fails while generating fails its own request with a 400 (a
stream: an error event) saying why, neither writes the schema to the log, and a plain request
running alongside gets exactly the greedy answer it gets alone."""
import concurrent.futures as cf
import json

import httpx
import pytest

from tests.engine.test_grammar import LATE, hostile_schema

MESSAGES = [{"role": "user", "content": "Fill in the form."}]
PLAIN = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(start_server, tiny_llama):
    """A server of its own: the failed requests here must not show in the shared one's metrics
    (tests/server/test_docs.py reads them)."""
    return start_server(tiny_llama)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=300)


def constrained(schema, n, **kw):
    return {"messages": MESSAGES, "n": n, "max_tokens": 50, "temperature": 1.0, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}, **kw}


def alongside(server, bodies):
    """The plain request's text when it runs among `bodies` (chat requests), and their responses."""
    with cf.ThreadPoolExecutor(len(bodies) + 1) as pool:
        others = [pool.submit(post, server, "/v1/chat/completions", b) for b in bodies]
        plain = pool.submit(post, server, "/v1/completions", PLAIN)
        return plain.result().json()["choices"][0]["text"], [f.result() for f in others]


def test_a_schema_too_complex_for_a_step_is_a_400_and_the_log_stays_small(server):
    alone = post(server, "/v1/completions", PLAIN).json()["choices"][0]["text"]
    logged = len(server.log())
    text, answers = alongside(server, [constrained(hostile_schema(), 64) for _ in range(3)])
    assert text == alone
    for r in answers:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "response_format" and "too complex" in error["message"]
        assert len(error["message"]) < 400
    assert len(server.log()) - logged < 10_000   # the schema is 170 KB: never in the log


def test_a_grammar_failing_while_generating_fails_its_own_request_saying_why(server):
    alone = post(server, "/v1/completions", PLAIN).json()["choices"][0]["text"]
    logged = len(server.log())
    text, answers = alongside(server, [constrained(LATE, 8), constrained(LATE, 8, stream=True)])
    assert text == alone
    plain, streamed = answers
    assert plain.status_code == 400, plain.text
    error = plain.json()["error"]
    assert (error["param"], error["code"]) == ("response_format", "grammar_failed") and "items" in error["message"]
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "grammar_failed" and last["error"]["param"] == "response_format"
    # a line per failed choice at most, each cut short; never a traceback, never the schema
    added = server.log()[logged:]
    assert len(added) < 16 * 600 and "Traceback" not in added
