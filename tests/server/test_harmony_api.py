"""gpt-oss through `pdserve serve --reasoning-parser gpt_oss` with the official openai client, on a
tiny gpt-oss checkpoint with gpt-oss's vocabulary whose greedy answers are harmony scripts
(tests/server/harmony_model.py): the prompt is harmony's rendering (tools, reasoning effort, an
earlier call and its result), the analysis channel arrives in reasoning_content and the final
channel in content, a commentary message to a function as tool_calls, streamed as not, on chat
completions and on /v1/responses (reasoning and function_call items); a call stops the request at
<|call|> (harmony's stop token, not the checkpoint's eos); what harmony cannot do is a 400, and a
checkpoint without harmony's vocabulary is refused in one line."""
import httpx
import openai
import pytest

from pdserve.server.harmony import encoding
from tests.server.harmony_model import (ASK, ASK_WEATHER, CALL_ARGS, CONTENT, REASONING, SCRIPTS, TOOL_TURN, TOOLS,
                                        harmony_model)  # noqa: F401 (a fixture)
from tests.server.test_reasoning_api import added_up, fields, prompt_ids, serve_fails


@pytest.fixture(scope="module")
def harmony_server(start_server, harmony_model):
    return start_server(harmony_model, "--reasoning-parser", "gpt_oss", "--served-model-name", "gpt-oss")


@pytest.fixture(scope="module")
def client(harmony_server):
    return openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, messages, **kw):
    return client.chat.completions.create(model="gpt-oss", messages=messages, temperature=0,
                                          max_completion_tokens=40, **kw)


def streamed(client, messages, **kw):
    return added_up(ask(client, messages, stream=True, **kw))


def test_analysis_is_reasoning_and_final_is_content(client):
    r = ask(client, ASK)
    assert fields(r.choices[0].message) == (REASONING[0], CONTENT[0])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    reasoning, content, calls, finish, kinds = streamed(client, ASK)
    assert (reasoning, content, calls, finish) == (REASONING[0], CONTENT[0], [], "stop")
    assert kinds == sorted(kinds, reverse=True)   # reasoning deltas, then content


def test_the_prompt_is_harmonys_rendering(client):
    r = ask(client, ASK, extra_body={"prompt_logprobs": 0})
    text = encoding().decode(prompt_ids(r)[1:])
    assert text.endswith("<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant")
    assert "Reasoning: medium" in text   # harmony's default effort
    high = ask(client, ASK, reasoning_effort="high", extra_body={"prompt_logprobs": 0})
    assert "Reasoning: high" in encoding().decode(prompt_ids(high)[1:])


def test_a_commentary_call_is_tool_calls_and_stops_at_call(client):
    r = ask(client, ASK_WEATHER, tools=TOOLS)
    choice = r.choices[0]
    assert fields(choice.message) == (REASONING[1], None) and choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", CALL_ARGS)
    # the request ended at <|call|>, the script's last token, though the checkpoint's eos is <|return|>
    script = encoding().encode(SCRIPTS[1][1], allowed_special="all")
    assert r.usage.completion_tokens == len(script)
    reasoning, content, calls, finish, kinds = streamed(client, ASK_WEATHER, tools=TOOLS)
    assert (reasoning, content, finish) == (REASONING[1], None, "tool_calls")
    assert calls == [{"name": "get_weather", "arguments": CALL_ARGS}] and kinds[0] == "reasoning"


def test_the_tools_answer_goes_back_as_harmony_and_the_model_answers(client):
    r = ask(client, TOOL_TURN, tools=TOOLS)
    assert fields(r.choices[0].message) == (None, CONTENT[2]) and r.choices[0].finish_reason == "stop"
    assert streamed(client, TOOL_TURN, tools=TOOLS)[:4] == (None, CONTENT[2], [], "stop")


def responses_tools():
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"]} for t in TOOLS]


def test_responses_have_reasoning_items_and_function_calls(client):
    r = client.responses.create(model="gpt-oss", input=ASK[0]["content"], temperature=0)
    assert [(o.type, (o.content[0].text)) for o in r.output] == [("reasoning", REASONING[0]), ("message", CONTENT[0])]
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    call = client.responses.create(model="gpt-oss", input=ASK_WEATHER[0]["content"], tools=responses_tools(),
                                   temperature=0)
    assert [o.type for o in call.output] == ["reasoning", "function_call"]
    fc = call.output[1]
    assert (fc.name, fc.arguments, call.status) == ("get_weather", CALL_ARGS, "completed")
    # the stored turn (its thinking and call) and the call's output render as the chat's tool turn did
    answer = client.responses.create(model="gpt-oss", previous_response_id=call.id, tools=responses_tools(),
                                     input=[{"type": "function_call_output", "call_id": fc.call_id,
                                             "output": "sunny"}], temperature=0)
    assert [(o.type, o.content[0].text) for o in answer.output] == [("message", CONTENT[2])]


def test_responses_stream_the_same_items(client):
    events = list(client.responses.create(model="gpt-oss", input=ASK_WEATHER[0]["content"], tools=responses_tools(),
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert (thought, args) == (REASONING[1], CALL_ARGS)
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.function_call_arguments.delta")
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "function_call"] and final.output[1].name == "get_weather"
    low = client.responses.create(model="gpt-oss", input=ASK[0]["content"], reasoning={"effort": "low"})
    assert low.status in ("completed", "incomplete")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_object"}}}, "text"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning"),
])
def test_what_harmony_does_not_serve_is_a_400(harmony_server, path, body, param):
    r = httpx.post(harmony_server.url + path, json={"model": "gpt-oss", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_reasoning_effort_needs_the_gpt_oss_parser(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 4, "reasoning_effort": "low"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def test_a_checkpoint_without_harmonys_vocabulary_is_refused_in_one_line(make_tiny):
    err = serve_fails("--model", make_tiny("gpt_oss"), "--reasoning-parser", "gpt_oss")
    assert err.count("\n") == 0 and "o200k_harmony" in err, err
