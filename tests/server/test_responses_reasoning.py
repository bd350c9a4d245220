"""/v1/responses with `--reasoning-parser qwen3`, through the official openai client, on the tiny
Qwen3 checkpoint scripted to think (tests/server/thinking_model.py): the thinking is a reasoning
item before the message, streamed as reasoning_text events before the answer's; tool calls and
text.format apply to the answer only; the stored turn's thinking goes back to the template as
chat's reasoning_content does; chat_template_kwargs turns thinking off."""
import json

import jsonschema
import openai
import pytest

from pdserve.tokenizer import Tokenizer
from tests.server.thinking_model import (ANSWER, CONTENT, DIGIT, REASONING, WEATHER,  # noqa: F401
                                         thinking_model)   # a fixture

QUESTION = "What is the weather in Paris?"
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def client(start_server, thinking_model):
    server = start_server(thinking_model, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                          "--served-model-name", "thinking")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, **kw):
    return client.responses.create(model="thinking", input=QUESTION, temperature=0,
                                   **{"max_output_tokens": 32, **kw})


def split(r) -> tuple:
    """(reasoning text, message text, [(name, arguments)]) of a response's output, checking the order."""
    kinds = [o.type for o in r.output]
    assert kinds == sorted(kinds, key=["reasoning", "message", "function_call"].index)
    reasoning = [o for o in r.output if o.type == "reasoning"]
    assert len(reasoning) <= 1 and all(o.summary == [] for o in reasoning)
    return (reasoning[0].content[0].text if reasoning else None,
            "".join(o.content[0].text for o in r.output if o.type == "message") or None,
            [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"])


def test_thinking_is_a_reasoning_item_before_the_message(client, thinking_model):
    r = ask(client)
    assert split(r) == (REASONING, CONTENT, []) and r.status == "completed"
    assert r.output_text == CONTENT
    # the reasoning's tokens: its text re-tokenized (one token per scripted piece here)
    tok = Tokenizer.from_dir(thinking_model)
    assert r.usage.output_tokens_details.reasoning_tokens == len(tok.encode(REASONING, add_special_tokens=False)) > 0
    events = list(ask(client, stream=True))
    types = [e.type for e in events]
    first_text = types.index("response.output_text.delta")
    assert "response.reasoning_text.delta" in types[:first_text]
    assert "response.reasoning_text.delta" not in types[first_text:]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == CONTENT
    assert split(events[-1].response) == split(r)


def test_tools_and_formats_apply_to_the_answer_not_the_thinking(client):
    r = ask(client, tools=TOOLS)   # "auto": the hermes parser reads the answer; the thinking's call stays thinking
    assert split(r) == (REASONING, ANSWER, [("get_weather", {"city": "Paris"})])
    assert split(list(ask(client, tools=TOOLS, stream=True))[-1].response) == split(r)
    required = ask(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
    reasoning, text, calls = split(required)
    assert reasoning == REASONING and text is None and [c[0] for c in calls] == ["get_weather"]
    jsonschema.validate(calls[0][1], WEATHER)
    fmt = {"format": {"type": "json_schema", "name": "digit", "schema": DIGIT, "strict": True}}
    shaped = ask(client, text=fmt)
    reasoning, text, _ = split(shaped)
    assert reasoning == REASONING   # free text: the grammar starts after </think>
    jsonschema.validate(json.loads(text), DIGIT)


def test_a_stored_turns_thinking_goes_back_to_the_template(client, thinking_model):
    first = ask(client)
    second = client.responses.create(model="thinking", previous_response_id=first.id, input="And tomorrow?",
                                     max_output_tokens=1, temperature=0)
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING},
               {"role": "user", "content": "And tomorrow?"}]
    tok = Tokenizer.from_dir(thinking_model)
    assert second.usage.input_tokens == len(tok.encode_chat(history))
    # the same, with the items sent back in full (as clients that do not store responses do)
    again = client.responses.create(model="thinking", max_output_tokens=1, temperature=0, store=False, input=[
        {"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in first.output],
        {"role": "user", "content": "And tomorrow?"}])
    assert again.usage.input_tokens == second.usage.input_tokens


def test_chat_template_kwargs_turn_thinking_off(client):
    r = ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert split(r) == (None, CONTENT, [])
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, extra_body={"chat_template_kwargs": {"tools": []}})
    assert e.value.body["param"] == "chat_template_kwargs"
