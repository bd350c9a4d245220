"""Tool calling through the official openai client, on a random-weight model whose chat template
renders tools (Hermes/Qwen2.5 style): tools reach the template; "required" and named choices always
give tool calls that parse, name a declared tool and validate against its schema, streamed and
not; "auto" is parsed by --tool-call-parser; tool results go back through the template."""
import concurrent.futures as cf
import json
import os
import shutil

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.args import DEFAULT_MODEL
from pdserve.server.tool_calls import MAX_CALLS
from pdserve.server.tool_parsers import HermesParser, Llama3JsonParser
from pdserve.tokenizer import Tokenizer

TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
          "required": ["query", "limit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tiny_qwen2, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tools") / "tiny-tools")
    shutil.copytree(tiny_qwen2, path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def tool_server(start_server, tool_model):
    return start_server(tool_model, "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def check_calls(calls, names=SCHEMAS):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def streamed(client, **kw):
    """(content, {index: call dict}, finish_reason) from a stream's deltas, accumulated as clients do."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, calls, finish


def test_tools_reach_the_chat_template(client, model, tool_model):
    tok = Tokenizer.from_dir(tool_model)
    with_tools = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_completion_tokens=1,
                                                tool_choice="auto")
    without = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=1)
    assert with_tools.usage.prompt_tokens == len(tok.encode_chat(MESSAGES, tools=TOOLS)) > without.usage.prompt_tokens
    none = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_completion_tokens=1)
    assert none.usage.prompt_tokens == without.usage.prompt_tokens   # "none": the tools are not offered


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_required_always_gives_valid_tool_calls(client, model, temperature):
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_completion_tokens=400,
              temperature=temperature)
    with cf.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda s: client.chat.completions.create(**kw, seed=s, n=2), range(8)))
    choices = [c for a in answers for c in a.choices]
    assert len(choices) == 16
    for c in choices:   # 100%: every answer is tool calls
        assert c.finish_reason == "tool_calls" and c.message.content is None
        check_calls(c.message.tool_calls)
    content, calls, finish = streamed(client, **kw, seed=3)
    assert finish == "tool_calls" and not content and calls
    for call in calls.values():
        assert call["id"].startswith("call_") and call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_parallel_tool_calls_false_gives_one_call(client, model):
    for s in range(4):
        r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_completion_tokens=400, temperature=1.0,
                                           seed=s)
        assert len(r.choices[0].message.tool_calls) == 1


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")   # no free extra keys: the answer is bounded
    street: str = Field(max_length=12)
    city: str = Field(max_length=12)


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    home: Address


class Parcel(BaseModel):   # another "Address" in its own $defs, not the Person's
    model_config = ConfigDict(extra="forbid")

    class Address(BaseModel):
        model_config = ConfigDict(extra="forbid")
        zip: int = Field(ge=0, le=99999)
    to: Address


def test_required_takes_parameters_with_defs_as_pydantic_writes_them(client, model):
    schemas = {"add_person": Person.model_json_schema(), "send_parcel": Parcel.model_json_schema()}
    assert all("$defs" in s for s in schemas.values())
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in schemas.items()]
    names = set()
    for seed, offered in enumerate([tools] * 4 + [tools[:1], tools[1:]]):
        r = client.chat.completions.create(model=model, messages=MESSAGES, tools=offered, tool_choice="required",
                                           parallel_tool_calls=False, max_completion_tokens=180, temperature=1.0,
                                           seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        for call in c.message.tool_calls:   # each call's arguments valid for its own tool's $defs
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            names.add(call.function.name)
    assert names == set(schemas)


def test_required_calls_are_bounded_and_a_cut_answer_has_only_whole_calls(client, model):
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0)
    for seed in range(4):
        c = client.chat.completions.create(**kw, seed=seed).choices[0]   # max_tokens: the rest of the context
        assert c.finish_reason == "tool_calls" and 1 <= len(c.message.tool_calls) <= MAX_CALLS
    # cut by max_tokens in mid-array: "length", no content, only the calls that were whole
    for max_tokens in (3, 25, 40):
        c = client.chat.completions.create(**kw, max_completion_tokens=max_tokens, seed=1).choices[0]
        assert c.finish_reason == "length" and c.message.content is None
        for call in c.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        content, calls, finish = streamed(client, **kw, max_completion_tokens=max_tokens, seed=1)
        assert (content, finish) == ("", "length")
        assert [(x["name"], x["arguments"]) for x in calls.values()] == \
            [(x.function.name, x.function.arguments) for x in c.message.tool_calls or []]
    # a stop string before the first call: "stop" without calls, streamed or not, never "tool_calls"
    c = client.chat.completions.create(**kw, stop=["{"], seed=1).choices[0]
    assert (c.finish_reason, c.message.content, c.message.tool_calls) == ("stop", None, None)
    assert streamed(client, **kw, stop=["{"], seed=1) == ("", {}, "stop")


@pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")),
                    reason="the bundled default model has not been built")
def test_the_docs_required_example_on_the_bundled_model(start_server):
    """docs/API.md's example, as a new user runs it: the answer is tool calls, not JSON in content."""
    server = start_server(None, "--num-kv-blocks", "128")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
        "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for parallel in (True, False):
        r = client.chat.completions.create(model="default-model", messages=messages, tools=tools,
                                           tool_choice="required", parallel_tool_calls=parallel)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert 1 <= len(c.message.tool_calls) <= (MAX_CALLS if parallel else 1)
        call = c.message.tool_calls[0]
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    server.stop()


def test_a_named_function_is_the_one_called(client, model):
    choice = {"type": "function", "function": {"name": "search"}}
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_completion_tokens=300)
    answers = {}
    for temp in (0, 1.2):
        r = client.chat.completions.create(**kw, temperature=temp, seed=4)
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message.tool_calls, names={"search"})
        assert len(r.choices[0].message.tool_calls) == 1
        answers[temp] = r.choices[0].message.tool_calls[0].function.arguments
    content, calls, finish = streamed(client, **kw, temperature=0)
    assert finish == "tool_calls" and not content and list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == ("search", answers[0])


HERMES_ANSWER = ('start: "Let me check." call\n'
                 'call: "<tool_call>" %json {"type": "object", "properties": {"name": {"const": "get_weather"}, '
                 '"arguments": ' + json.dumps(WEATHER) + '}, "required": ["name", "arguments"], '
                 '"additionalProperties": false} "</tool_call>"')


def test_auto_answers_are_parsed_by_the_hermes_parser(client, model):
    # A random model rarely writes a call by itself: a grammar makes it write one in Hermes' format.
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, max_completion_tokens=300, temperature=0,
              extra_body={"structured_outputs": {"grammar": HERMES_ANSWER}})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    check_calls(c.message.tool_calls, names={"get_weather"})
    content, calls, finish = streamed(client, **kw)
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(x["name"], x["arguments"]) for x in calls.values()] == \
        [(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)]
    # a plain answer is content, streamed in full
    plain = dict(model=model, messages=MESSAGES, tools=TOOLS, max_completion_tokens=20, temperature=0)
    free = client.chat.completions.create(**plain)
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content
    content, calls, _ = streamed(client, **plain)
    assert content == free.choices[0].message.content and not calls


def test_tool_results_go_back_through_the_template(client, model, tool_model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_completion_tokens=400, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r2 = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_completion_tokens=1)
    rendered = Tokenizer.from_dir(tool_model).apply_chat_template(
        [MESSAGES[0], {"role": "assistant", "content": "", "tool_calls": [
            {**call.model_dump(), "function": {"name": call.function.name,
                                               "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "content": '{"temp": 21}', "tool_call_id": call.id}], tools=TOOLS)
    assert "<tool_response>\n{\"temp\": 21}" in rendered and call.function.name in rendered
    assert r2.usage.prompt_tokens == len(Tokenizer.from_dir(tool_model).encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(tool_server, body, param):
    r = httpx.post(tool_server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_auto_needs_a_parser(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in r.json()["error"]["message"]
    # required needs none
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS,
                                                             "tool_choice": "required", "max_tokens": 400})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]


def test_parsers_on_known_answers():
    h = HermesParser()
    assert h.parse('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                   '<tool_call>{"name": "g", "arguments": {}}</tool_call>') == \
        ("Sure.", [("f", '{"a": 1}'), ("g", "{}")])
    assert h.parse("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    assert h.parse("no call") == ("no call", [])
    assert h.content_prefix("abc <tool", False) == 4 and h.content_prefix("abc <x", False) == 6
    j = Llama3JsonParser()
    assert j.parse('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}') == \
        (None, [("f", '{"x": "y"}'), ("g", "{}")])
    assert j.parse('{"name": "f"') == ('{"name": "f"', [])
    assert j.parse("Hello") == ("Hello", [])
    assert j.content_prefix("{", False) == 0 and j.content_prefix("Hi", False) == 2
