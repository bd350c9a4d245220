"""/v1/responses' parts without a server: chat deltas become output items and stream events the
openai client's own types accept (a reasoning split's reasoning_content included: how a reasoning
parser plugs in), input items become chat messages, the store keeps the last N and says why it
no longer has one."""
import pytest
from pydantic import TypeAdapter

from openai.types.responses import ResponseOutputItem, ResponseStreamEvent

from pdserve.errors import RequestError
from pdserve.server.responses_api import _as_assistant_message, _input_messages
from pdserve.server.responses_output import OutputBuilder, message_deltas
from pdserve.server.responses_protocol import ResponsesRequest
from pdserve.server.responses_store import ResponseStore

EVENT = TypeAdapter(ResponseStreamEvent)
ITEM = TypeAdapter(ResponseOutputItem)


def run(builder: OutputBuilder, deltas: list[dict], status="completed") -> list[dict]:
    events = [e for d in deltas for e in builder.feed(d)] + builder.finish(status)
    for seq, e in enumerate(events):   # every event is one the client parses
        EVENT.validate_python({**e, "sequence_number": seq})
    for item in builder.items:
        ITEM.validate_python(item)
    return events


def test_reasoning_then_text_then_calls_become_three_kinds_of_items():
    b = OutputBuilder()
    events = run(b, [{"reasoning_content": "Let me "}, {"reasoning_content": "think."}, {"content": "Sure"},
                     {"content": "."},
                     {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]},
                     {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
                     {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                     {"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                      "function": {"name": "g", "arguments": "{}"}}]}])
    assert [i["type"] for i in b.items] == ["reasoning", "message", "function_call", "function_call"]
    assert b.items[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert b.items[1]["content"][0]["text"] == "Sure."
    assert [(i["call_id"], i["name"], i["arguments"]) for i in b.items[2:]] == \
        [("call_1", "f", '{"a": 1}'), ("call_2", "g", "{}")]
    assert all(i["status"] == "completed" for i in b.items)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2, 3]
    # an item as added is a snapshot: it is not changed by what comes after
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    # the next turn's template gets the answer's text, calls and reasoning (as chat's reasoning_content)
    assert _as_assistant_message(b.items) == {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}],
        "reasoning_content": "Let me think.", "reasoning": "Let me think."}


def test_a_finished_message_with_reasoning_gives_the_same_items_as_its_stream():
    message = {"reasoning_content": "Hmm.", "content": "Hi", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    whole, streamed = OutputBuilder(), OutputBuilder()
    run(whole, message_deltas(message))
    run(streamed, [{"reasoning_content": "Hm"}, {"reasoning_content": "m."}, {"content": "H"}, {"content": "i"},
                   {"tool_calls": [{"index": 0, "id": "call_9", "function": {"name": "f", "arguments": "{}"}}]}])
    def strip(items):
        return [{k: v for k, v in i.items() if k != "id"} for i in items]
    assert strip(whole.items) == strip(streamed.items)


def test_a_cut_answer_leaves_its_last_item_incomplete():
    b = OutputBuilder()
    events = run(b, [{"content": "a"}, {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f"}}]}],
                 status="incomplete")
    assert [i["status"] for i in b.items] == ["completed", "incomplete"]
    assert events[-1]["item"]["status"] == "incomplete"
    assert OutputBuilder().finish() == []   # nothing generated: no items, no events


def test_input_items_become_chat_messages():
    body = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Calling.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Hmm."}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Mm."}]},
        {"type": "function_call", "call_id": "c4", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c5", "name": "f", "arguments": "{}"}]})
    assert _input_messages(body.input) == [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": "", "reasoning_content": "Hmm.\nMm.", "reasoning": "Hmm.\nMm.",
         "tool_calls": [{"id": "c4", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "c5", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    # parts of the wrong kind for their place are refused
    for bad in ({"role": "user", "content": [{"type": "reasoning_text", "text": "x"}]},
                {"type": "reasoning", "content": [{"type": "input_text", "text": "x"}]}):
        with pytest.raises(ValueError, match="takes parts of type"):
            ResponsesRequest.model_validate({"input": [bad]})
    assert _input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_the_store_keeps_the_last_n_and_says_why_it_has_no_more():
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}])
    store.not_stored("r3")
    assert len(store) == 2 and store.conversation("r2") == [{"role": "user", "content": "2"}]
    store.conversation("r2").append({"role": "user", "content": "more"})   # a caller's copy
    assert len(store.conversation("r2")) == 1
    for rid, why in (("r0", "keeps the last 2"), ("r3", "store: false"), ("nope", "no response with this id")):
        with pytest.raises(RequestError) as e:
            store.conversation(rid)
        assert why in str(e.value) and e.value.param == "previous_response_id"
    none = ResponseStore(0)
    none.put("x", [])
    with pytest.raises(RequestError, match="stores no responses"):
        none.conversation("x")


# ---- on the fake engine (tests/server/fake_engine.py), whose k-th token is chr(ord("a") + k % 26)
# and whose template is one "role: content" line per message

def sse_events(text: str) -> list[dict]:
    import json
    frames = [f.split("\n") for f in text.split("\n\n") if f]
    assert all(e == f"event: {json.loads(d[6:])['type']}" for e, d in frames)
    return [json.loads(d[6:]) for _, d in frames]


def test_on_the_fake_engine_the_text_and_prompt_are_exact():
    import httpx
    from tests.server.fake_engine import FakeEngine
    from tests.server.inprocess import serve, wait_idle
    with serve(FakeEngine(max_model_len=256)) as url:
        body = {"instructions": "Be kind.", "input": "Hi", "max_output_tokens": 5}
        r = httpx.post(url + "/v1/responses", json=body).json()
        assert r["output"][0]["content"][0]["text"] == "abcde" and r["status"] == "incomplete"
        prompt = "system: Be kind.\nuser: Hi\nassistant:"
        assert r["usage"]["input_tokens"] == len(prompt) and r["usage"]["output_tokens"] == 5
        events = sse_events(httpx.post(url + "/v1/responses", json={**body, "stream": True}).text)
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "abcde"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        nxt = httpx.post(url + "/v1/responses", json={"previous_response_id": r["id"], "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "More"}]}], "max_output_tokens": 1}).json()
        assert nxt["usage"]["input_tokens"] == len("user: Hi\nassistant: abcde\nuser: More\nassistant:")
        wait_idle(url)


def test_a_stream_that_fails_ends_with_error_and_response_failed():
    import httpx
    from tests.server.fake_engine import FakeEngine
    from tests.server.inprocess import serve
    with serve(FakeEngine(max_model_len=256, step_time=0.05), request_timeout=0.3) as url:
        events = sse_events(httpx.post(url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 100,
                                                                   "stream": True}, timeout=30).text)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["code"] == "request_timeout" and events[-1]["response"]["status"] == "failed"
        assert events[-1]["response"]["error"]["code"] == "server_error"
        assert events[-1]["response"]["error"]["type"] == "request_timeout"
        assert events[-1]["response"]["output"][0]["content"][0]["text"].startswith("ab")   # what came before
        for seq, e in enumerate(events):
            EVENT.validate_python(e)
            assert e["sequence_number"] == seq
        r = httpx.post(url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 100}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        # a failed response is not stored
        rid = events[0]["response"]["id"]
        r = httpx.post(url + "/v1/responses", json={"input": "Hi", "previous_response_id": rid})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
