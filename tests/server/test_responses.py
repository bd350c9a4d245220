"""POST /v1/responses through the official openai client (`client.responses.create`), on a
random-weight model whose chat template renders tools: plain and streamed answers are chat's
answers in the Responses API's shape (same prompt, same greedy tokens), the stream's events
come in the documented order with consecutive sequence numbers and its deltas add up to the
final text; forced tool choices give function_call items whose arguments validate; text.format
json_schema gives JSON that validates; previous_response_id puts the earlier turn in the prompt;
what is not supported is a 400 naming the field."""
import json
import os
import shutil

import httpx
import jsonschema
import openai
import pytest

from pdserve.tokenizer import Tokenizer
from tests.server.test_tool_calls import SCHEMAS, TEMPLATE

TOOLS = [{"type": "function", "name": name, "description": f"the {name} tool", "parameters": schema}
         for name, schema in SCHEMAS.items()]
STORED = 3   # --max-stored-responses of the test server


@pytest.fixture(scope="module")
def tool_model(tiny_qwen2, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("responses") / "tiny-tools")
    shutil.copytree(tiny_qwen2, path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def tok(tool_model):
    return Tokenizer.from_dir(tool_model)


@pytest.fixture(scope="module")
def srv(start_server, tool_model):
    return start_server(tool_model, "--tool-call-parser", "hermes", "--max-stored-responses", str(STORED))


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def message_text(r) -> str:
    assert [o.type for o in r.output] == ["message"]
    (part,) = r.output[0].content
    assert part.type == "output_text"
    return part.text


BRIEF = "Be brief. " * 8   # long enough for whole KV blocks: a repeat is served from the prefix cache


def test_a_plain_answer_is_chats_answer(client, tok):
    messages = [{"role": "system", "content": BRIEF}, {"role": "user", "content": "Hello there"}]
    r = client.responses.create(model="tiny-tools", instructions=BRIEF, input="Hello there",
                                max_output_tokens=12, temperature=0, metadata={"run": "1"})
    chat = client.chat.completions.create(model="tiny-tools", messages=messages, max_completion_tokens=12,
                                          temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny-tools"
    assert message_text(r) == r.output_text == chat.choices[0].message.content
    assert r.output[0].role == "assistant" and r.output[0].id.startswith("msg_")
    assert r.usage.input_tokens == len(tok.encode_chat(messages)) == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0
    if chat.choices[0].finish_reason == "length":
        assert (r.status, r.incomplete_details.reason, r.output[0].status) == \
            ("incomplete", "max_output_tokens", "incomplete")
    else:
        assert (r.status, r.output[0].status) == ("completed", "completed")
    assert (r.instructions, r.metadata, r.max_output_tokens, r.temperature) == (BRIEF, {"run": "1"}, 12, 0)
    # items as input: the same prompt as the string
    items = client.responses.create(model="tiny-tools", instructions=BRIEF, max_output_tokens=12,
                                    temperature=0, input=[{"role": "user", "content": [
                                        {"type": "input_text", "text": "Hello there"}]}])
    assert items.output_text == r.output_text and items.usage.input_tokens == r.usage.input_tokens
    # the prompt was seen before: cached tokens as chat counts them
    assert items.usage.input_tokens_details.cached_tokens == chat.usage.prompt_tokens_details.cached_tokens > 0


def collect(stream) -> list:
    return list(stream)


def test_a_streamed_answer_comes_as_responses_events_in_order(client):
    kw = dict(model="tiny-tools", input="Tell me a story", max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kw)
    events = collect(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    n = types.count("response.output_text.delta")
    assert n >= 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * n + \
        ["response.output_text.done", "response.content_part.done", "response.output_item.done",
         f"response.{whole.status}"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-4]
    assert deltas == done.text == whole.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    final = events[-1].response
    assert item_ids == {final.output[0].id} and final.output_text == deltas
    assert final.usage.output_tokens == whole.usage.output_tokens and final.usage.input_tokens == whole.usage.input_tokens


def check_call(item, names=SCHEMAS):
    assert item.type == "function_call" and item.call_id.startswith("call_") and item.id.startswith("fc_")
    assert item.name in names and item.status == "completed"
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


@pytest.mark.parametrize("choice,names", [("required", SCHEMAS),
                                          ({"type": "function", "name": "search"}, {"search"})])
def test_forced_tool_choices_give_function_call_items(client, choice, names):
    kw = dict(model="tiny-tools", input="What is the weather in Paris?", tools=TOOLS, tool_choice=choice,
              max_output_tokens=300, temperature=0, parallel_tool_calls=False)
    r = client.responses.create(**kw)
    assert r.status == "completed" and len(r.output) == 1
    check_call(r.output[0], names)
    assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == "search"
    assert [t.name for t in r.tools] == list(SCHEMAS)
    events = collect(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    n = types.count("response.function_call_arguments.delta")
    assert n >= 1 and types == ["response.created", "response.in_progress", "response.output_item.added"] + \
        ["response.function_call_arguments.delta"] * n + \
        ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    item = events[-1].response.output[0]
    check_call(item, names)
    assert args == events[-3].arguments == item.arguments == r.output[0].arguments   # greedy: the same call
    assert item.name == r.output[0].name == events[2].item.name


def test_text_format_json_schema_gives_valid_json(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    for strict in (True, False):
        r = client.responses.create(model="tiny-tools", input="Describe a person", temperature=1.0,
                                    text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                     "strict": strict}}, max_output_tokens=200)
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    r = client.responses.create(model="tiny-tools", input="Some JSON", temperature=0, max_output_tokens=200,
                                text={"format": {"type": "json_object"}})
    if r.status == "completed":   # a random model's object may be longer than 200 tokens
        assert isinstance(json.loads(r.output_text), dict)


def test_previous_response_id_continues_the_conversation(client, tok):
    first = client.responses.create(model="tiny-tools", input="My name is Ada.", max_output_tokens=6,
                                    temperature=0)
    second = client.responses.create(model="tiny-tools", previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=1, instructions="Answer.")
    conversation = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == len(tok.encode_chat(conversation))
    # a tool call and its result: the call is in the stored turn, the output goes back as a tool message
    made = client.responses.create(model="tiny-tools", input="Weather in Paris?", tools=TOOLS,
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=300,
                                   temperature=0)
    call = made.output[0]
    r = client.responses.create(model="tiny-tools", previous_response_id=made.id, tools=TOOLS,
                                tool_choice="none", max_output_tokens=1,
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": '{"temp": 21}'}])
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": call.call_id, "type": "function",
              "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
         {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}])
    assert "<tool_response>\n{\"temp\": 21}" in rendered and '"name": "get_weather"' in rendered
    assert r.usage.input_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_previous_response_id_refusals_say_why(client, srv):
    def refused(rid) -> str:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny-tools", previous_response_id=rid, input="Go on", max_output_tokens=1)
        assert e.value.body["param"] == "previous_response_id"
        return e.value.body["message"]
    assert "no response with this id" in refused("resp_unknown")
    unstored = client.responses.create(model="tiny-tools", input="Hi", max_output_tokens=1, store=False)
    assert unstored.store is False and "store: false" in refused(unstored.id)
    ids = [client.responses.create(model="tiny-tools", input=f"Hi {i}", max_output_tokens=1).id
           for i in range(STORED + 1)]
    assert "--max-stored-responses" in refused(ids[0])   # the oldest was pushed out
    for rid in ids[1:]:
        client.responses.create(model="tiny-tools", previous_response_id=rid, input="Go on", max_output_tokens=1,
                                store=False)


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto", "temperature": "hot"}, "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c1"}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"model": "other"}, "model"),
])
def test_what_is_not_supported_is_a_400_naming_the_field(srv, body, param):
    r = httpx.post(srv.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 4, **body})
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", r.text


def test_the_openai_client_raises_on_an_unknown_tool_type(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny-tools", input="Hi", tools=[{"type": "file_search",
                                                                          "vector_store_ids": ["vs_1"]}])
    assert e.value.body["param"] == "tools"


def aborts(m):
    return m.get('pdserve:request_success_total{finished_reason="abort"}', 0)


def test_a_client_that_leaves_a_stream_frees_its_request(srv):
    before = aborts(srv.metrics())
    body = {"input": "Once upon a time", "max_output_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = [next(lines) for _ in range(12)]
        assert first[0] == "event: response.created" and first[1].startswith("data: ")
        assert srv.metrics()["pdserve:kv_cache_usage_perc"] > 0   # mid-stream
    srv.wait_for(lambda m: aborts(m) == before + 1 and m["pdserve:kv_cache_usage_perc"] == 0
                 and m["pdserve:num_requests_running"] == 0, timeout=5)


def test_raw_bodies_are_what_the_openai_types_require(srv):
    """Validated (not just constructed, as the client does) by the openai package's own models; each
    server-sent event is named by its type, and the stream ends with response.completed/.incomplete."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    body = {"input": "Hi", "max_output_tokens": 5, "tools": TOOLS, "tool_choice": "required",
            "text": {"format": {"type": "json_object"}}}
    r = httpx.post(srv.url + "/v1/responses", json=body)
    assert r.status_code == 200
    parsed = Response.model_validate(r.json())
    assert parsed.usage.input_tokens_details.cached_tokens >= 0
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in s.read().decode().split("\n\n") if f]
    adapter = TypeAdapter(ResponseStreamEvent)
    for seq, frame in enumerate(frames):
        event_line, data_line = frame.split("\n")
        event = adapter.validate_json(data_line.removeprefix("data: "))
        assert event_line == f"event: {event.type}" and event.sequence_number == seq
    assert event.type in ("response.completed", "response.incomplete")


def test_required_cut_by_the_length_keeps_only_whole_calls(client):
    kw = dict(model="tiny-tools", input="Weather?", tools=TOOLS, tool_choice="required", temperature=0)
    for max_tokens in (3, 25, 40):
        r = client.responses.create(**kw, max_output_tokens=max_tokens)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        for item in r.output:   # the calls the length did not cut, each whole
            check_call(item)
        events = collect(client.responses.create(**kw, max_output_tokens=max_tokens, stream=True))
        final = events[-1].response
        assert events[-1].type == "response.incomplete"
        assert [(i.name, i.arguments, i.status) for i in final.output] == \
            [(i.name, i.arguments, i.status) for i in r.output]   # greedy: the same calls, streamed
