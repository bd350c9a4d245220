"""An OpenAI Agents SDK agent (`openai-agents`) on pdserve's /v1/responses: two function tools,
OpenAIResponsesModel over an AsyncOpenAI client, Runner's loop to a final answer. The random
model's words mean nothing; the protocol must hold: the first turn is forced to call a tool
(tool_choice "required"; the SDK then resets the choice, so the next turn is "auto", parsed by
--tool-call-parser hermes), the tool runs and its output goes back in the next request, and the
final answer is text in the agent's output type (text.format json_schema, bounded so that it
ends). Run plain, streamed, and chained by previous_response_id."""
import asyncio
import json
import os
import shutil
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

import agents   # openai-agents, pinned in the test extra
from openai import AsyncOpenAI

from tests.server.test_tool_calls import TEMPLATE

agents.set_tracing_disabled(True)   # no network here: the SDK would export traces to OpenAI

City = Literal["Paris", "Rome", "Oslo"]


class Answer(BaseModel):
    summary: str = Field(max_length=12)   # bounded: the answer ends on any model


@pytest.fixture(scope="module")
def agent_server(start_server, tiny_qwen2, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("agents") / "tiny-tools")
    shutil.copytree(tiny_qwen2, path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return start_server(path, "--tool-call-parser", "hermes")


def make_agent(url: str, ran: list, sent: list):
    """The agent, its tools appending to `ran`, its client appending each request body to `sent`."""
    @agents.function_tool
    def get_weather(city: City) -> str:
        """The weather in a city."""
        ran.append(("get_weather", city))
        return f"sunny in {city}"

    @agents.function_tool
    def get_time(city: City) -> str:
        """The local time in a city."""
        ran.append(("get_time", city))
        return f"noon in {city}"

    async def record(request: httpx.Request):
        sent.append(json.loads(request.content))
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.AsyncClient(event_hooks={"request": [record]}))
    model = agents.OpenAIResponsesModel(model="tiny-tools", openai_client=client)
    return agents.Agent(name="assistant", instructions="Use the tools, then answer.", model=model,
                        tools=[get_weather, get_time], output_type=Answer,
                        model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                            max_tokens=300))


def check_run(result, ran: list, sent: list, chained: bool):
    assert isinstance(result.final_output, Answer) and len(result.final_output.summary) <= 12
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds and kinds[-1] == "message_output_item"
    # every call the model made was run, and its output went back to the model
    calls = [i.raw_item for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert ran and len(ran) == len(calls) == len(outputs)
    assert {c.name for c in calls} <= {"get_weather", "get_time"}
    assert [o.output for o in outputs] == [("sunny in " if n == "get_weather" else "noon in ") + c for n, c in ran]
    first, last = result.raw_responses[0], result.raw_responses[-1]
    assert len(result.raw_responses) >= 2 and [o.type for o in first.output] == ["function_call"] * len(calls)
    # the last request's prompt holds the calls and their outputs: longer than the first by at least those
    assert last.usage.input_tokens > first.usage.input_tokens + len(outputs) * 3
    # what the SDK sent: "required" first, then its reset (no tool_choice: "auto"), the tools' outputs
    # (after the whole history, or after previous_response_id alone when chained)
    assert len(sent) == len(result.raw_responses)
    assert sent[0]["tool_choice"] == "required" and "tool_choice" not in sent[-1]
    assert sent[0]["text"]["format"]["type"] == "json_schema"
    returned = [i for i in sent[1]["input"] if i.get("type") == "function_call_output"]
    assert [i["output"] for i in returned] == [o.output for o in outputs]
    if chained:
        assert sent[1]["previous_response_id"] == first.response_id
        assert [i.get("type") for i in sent[1]["input"]] == ["function_call_output"] * len(outputs)
    else:
        assert "previous_response_id" not in sent[1]
        assert [i.get("type") for i in sent[1]["input"]].count("function_call") == len(calls)


async def run_agent(url: str, how: str):
    ran: list = []
    sent: list = []
    agent = make_agent(url, ran, sent)
    if how == "streamed":
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        events = [e async for e in result.stream_events()]
        assert any(e.type == "raw_response_event" and e.data.type == "response.output_text.delta" for e in events)
    else:
        result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4,
                                         auto_previous_response_id=how == "chained")
    check_run(result, ran, sent, chained=how == "chained")
    return result


def test_an_agent_calls_a_tool_and_answers(agent_server):
    runs = {how: asyncio.run(run_agent(agent_server.url, how)) for how in ("run", "streamed", "chained")}
    # greedy, so the three loops are one conversation: each turn's prompt the same length (a chained
    # request's stored history renders as the history the SDK sends in full), the same final answer
    prompts = {how: [r.usage.input_tokens for r in res.raw_responses] for how, res in runs.items()}
    assert prompts["run"] == prompts["streamed"] == prompts["chained"], prompts
    assert runs["run"].final_output == runs["streamed"].final_output == runs["chained"].final_output
