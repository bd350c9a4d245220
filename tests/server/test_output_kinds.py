"""Non-streamed responses ask the engine for final outputs only (no output per request and step);
streamed ones for every step. Both give the same text."""
import json

import httpx
import pytest

from pdserve.engine.llm_engine import LLMEngine
from tests.server.inprocess import serve

BODY = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(tiny_llama, max_num_batched_tokens=64)


def sse_events(r) -> list:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_only_streamed_requests_get_per_step_outputs(engine):
    kinds = []
    add = engine.add_request

    def recording_add(request_id, prompt, params, **kw):
        kinds.append(params.final_only)
        return add(request_id, prompt, params, **kw)
    engine.add_request = recording_add
    try:
        with serve(engine) as url, httpx.Client(base_url=url, timeout=60) as c:
            whole = c.post("/v1/completions", json={"model": "tiny", "prompt": "The sea", **BODY}).json()
            with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "The sea", "stream": True,
                                                           **BODY}) as r:
                chunks = sse_events(r)
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **BODY}
            c.post("/v1/chat/completions", json=chat).raise_for_status()
            with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                r.read()
            c.post("/generate", json={"prompts": ["a", "b"], "max_tokens": 4}).raise_for_status()
            with c.stream("POST", "/generate_stream", json={"prompt": "a", "max_tokens": 4}) as r:
                r.read()
    finally:
        engine.add_request = add
    assert kinds == [True, False, True, False, True, True, False]
    assert len([e for e in chunks if e["choices"][0]["text"]]) > 1
    assert "".join(e["choices"][0]["text"] for e in chunks) == whole["choices"][0]["text"]
