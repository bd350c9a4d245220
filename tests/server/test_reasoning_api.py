"""Reasoning through `pdserve serve --reasoning-parser qwen3` with the official openai client, on
a tiny Qwen3 checkpoint scripted to think (tests/server/thinking_model.py): the thinking arrives in
reasoning_content, the answer in content, streamed as not; chat_template_kwargs' enable_thinking
false changes the prompt's tokens and there is no thinking; a json_schema constrains the answer
only (the thinking before it is free text); the tool-call parser reads the answer, not a call the
thinking mentions; bad kwargs and a checkpoint without think tokens are refused in one line."""
import json
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest

from pdserve import cli
from pdserve.tokenizer import Tokenizer
from tests.server.thinking_model import (ANSWER, CALL, CONTENT, DIGIT, REASONING, WEATHER,  # noqa: F401
                                         thinking_model)   # a fixture

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def server(start_server, thinking_model):
    return start_server(thinking_model, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                        "--served-model-name", "thinking")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, **kw):
    kw = {"max_completion_tokens": 32, **kw}
    return client.chat.completions.create(model="thinking", messages=MESSAGES, temperature=0, **kw)


def streamed(client, **kw):
    return added_up(ask(client, stream=True, **kw))


def added_up(chunks):
    """(reasoning, content, tool calls, finish_reason, order of delta kinds) from a stream, as clients add it up."""
    reasoning, content, calls, finish, kinds = "", "", {}, None, []
    for chunk in chunks:
        for ch in chunk.choices:
            d = ch.delta
            r = (d.model_extra or {}).get("reasoning_content")
            assert r == (d.model_extra or {}).get("reasoning")   # vLLM's name carries the same
            if r:
                reasoning += r
                kinds.append("reasoning")
            if d.content:
                content += d.content
                kinds.append("content")
            for t in d.tool_calls or []:
                call = calls.setdefault(t.index, {"name": "", "arguments": ""})
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
                kinds.append("call")
            finish = ch.finish_reason or finish
    return reasoning or None, content or None, list(calls.values()), finish, kinds


def fields(message):
    extra = message.model_extra or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")
    return extra.get("reasoning_content"), message.content


def test_thinking_goes_to_reasoning_content_the_answer_to_content(client):
    r = ask(client)
    assert fields(r.choices[0].message) == (REASONING, CONTENT)
    assert r.choices[0].finish_reason == "stop"
    reasoning, content, calls, finish, kinds = streamed(client)
    assert (reasoning, content, calls, finish) == (REASONING, CONTENT, [], "stop")
    assert kinds[0] == "reasoning" and kinds[-1] == "content" and kinds == sorted(kinds, reverse=True)


def prompt_ids(response) -> list[int]:
    """The prompt's token ids, from vLLM's prompt_logprobs (each position's entry holds its token)."""
    entries = response.model_extra["prompt_logprobs"]
    return [None] + [int(next(iter(e))) for e in entries[1:]]


def test_enable_thinking_false_reaches_the_template_and_there_is_no_thinking(client, server, thinking_model):
    tok = Tokenizer.from_dir(thinking_model)
    on = ask(client, extra_body={"prompt_logprobs": 0})
    off = ask(client, extra_body={"prompt_logprobs": 0, "chat_template_kwargs": {"enable_thinking": False}})
    expected = tok.encode_chat(MESSAGES, enable_thinking=False)
    assert prompt_ids(off)[1:] == expected[1:] and off.usage.prompt_tokens == len(expected)
    assert prompt_ids(on)[1:] == tok.encode_chat(MESSAGES)[1:]
    assert tok.decode(expected, skip_special_tokens=False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 4   # <think> \n\n </think> \n\n
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES,
                                                             "chat_template_kwargs": {"enable_thinking": False}})
    assert tokenized.json()["tokens"] == expected   # /tokenize renders the same prompt
    assert fields(off.choices[0].message) == (None, CONTENT)
    reasoning, content, _, _, kinds = streamed(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (reasoning, content) == (None, CONTENT) and set(kinds) == {"content"}


def test_an_earlier_turns_thinking_goes_back_to_the_template_and_does_not_end_this_one(client, thinking_model):
    first = ask(client).choices[0].message
    history = MESSAGES + [{"role": "assistant", "content": first.content,
                           "reasoning_content": first.model_extra["reasoning_content"]},
                          {"role": "user", "content": "And tomorrow?"}]
    r = client.chat.completions.create(model="thinking", messages=history, max_completion_tokens=32, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    tok = Tokenizer.from_dir(thinking_model)
    prompt = tok.decode(prompt_ids(r)[1:], skip_special_tokens=False)
    assert f"<think>\n{REASONING}\n</think>\n\n{CONTENT}<|im_end|>" in prompt   # the template got it
    assert fields(r.choices[0].message) == (REASONING, CONTENT)   # that </think> was an earlier turn's


def test_json_schema_constrains_the_answer_not_the_thinking(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "digit", "schema": DIGIT}}
    r = ask(client, response_format=fmt)
    reasoning, content = fields(r.choices[0].message)
    assert reasoning == REASONING   # free text, not JSON: the grammar had not started
    jsonschema.validate(json.loads(content), DIGIT)   # the scripted answer was masked out after </think>
    assert r.choices[0].finish_reason == "stop"
    assert streamed(client, response_format=fmt)[:2] == (reasoning, content)
    # without thinking the grammar holds from the first token
    off = ask(client, response_format=fmt, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert fields(off.choices[0].message) == (None, content)


def test_tool_calls_are_parsed_from_the_answer_not_the_thinking(client):
    r = ask(client, tools=TOOLS)
    m = r.choices[0].message
    assert fields(m) == (REASONING, ANSWER)   # the thinking mentions a call to Rome: it stays thinking
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == \
        [("get_weather", json.loads(CALL)["arguments"])]
    assert r.choices[0].finish_reason == "tool_calls"
    reasoning, content, calls, finish, _ = streamed(client, tools=TOOLS)
    assert (reasoning, content, finish) == (REASONING, ANSWER, "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_required_tool_choice_constrains_the_answer_after_thinking(client):
    r = ask(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_completion_tokens=64)
    m = r.choices[0].message
    assert fields(m)[0] == REASONING and m.content is None
    assert [c.function.name for c in m.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), WEATHER)


@pytest.mark.parametrize("kwargs, message", [
    ("enable_thinking", "chat_template_kwargs: Input should be a valid dictionary"),
    ({"add_generation_prompt": False}, "'add_generation_prompt' is set by the server"),
    ({"messages": []}, "'messages' is set by the server"),
    ({"tools": []}, "'tools' is set by the server")])
def test_bad_template_kwargs_are_a_400(server, kwargs, message):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": MESSAGES, "max_tokens": 4, "chat_template_kwargs": kwargs})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "chat_template_kwargs" and message in err["message"] and err["type"] == "invalid_request_error"


def serve_fails(*args) -> str:
    p = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--port", "0", *args], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    return p.stderr.strip()


def test_a_checkpoint_without_think_tokens_is_refused_in_one_line(tiny_llama):
    err = serve_fails("--model", tiny_llama, "--reasoning-parser", "qwen3")
    assert err.count("\n") == 0 and "'<think>' is not a single token" in err, err


def test_an_unknown_parser_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--reasoning-parser", "granite"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "invalid choice: 'granite'" in err and "deepseek_r1" in err and "qwen3" in err
    assert err.splitlines()[1:] == ["(see `pdserve serve --help`)"], err
