"""POST /v1/responses: OpenAI's Responses API over the chat machinery.

A request becomes one chat conversation (its `instructions` as the system message, the stored
conversation of `previous_response_id`, then its `input` items: messages, earlier
function_call and function_call_output items as assistant tool_calls and tool messages),
rendered by the chat template with its function tools; `tool_choice` and `text.format` become
the same tool plan (tool_calls.py) and grammar (structured.py) as chat's; the answer is parsed
the way chat parses it. Only the shape of the result differs: chat's message fields
(`reasoning_content`, `content`, `tool_calls`), or its stream's deltas, become output items
(responses_output.OutputBuilder): a `reasoning` item, a `message` with `output_text`,
`function_call` items, and while streaming the Responses events, numbered here.

Reasoning (--reasoning-parser): the chat path's split (pdserve/server/reasoning.py) of a finished
answer (chat's own `openai_api.answer_fields`) and of a streamed one (chat's `openai_api.AnswerStream`) gives
`reasoning_content`, which OutputBuilder makes a reasoning item; tool calls and text.format apply to the answer after it.
"""
import contextlib
import time
from types import SimpleNamespace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.engine.grammar import GrammarSpec
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import RequestError
from pdserve.server import reasoning, tool_calls
from pdserve.server.admission import ServerState, get_state
from pdserve.server.errors import APIError
from pdserve.server.openai_api import AnswerStream, answer_fields, reasoning_start, render_prompt
from pdserve.server.responses_output import OutputBuilder, message_deltas, new_id
from pdserve.server.responses_protocol import InputItem, ResponsesRequest, join_text, refuse_unsupported
from pdserve.server.responses_store import ResponseStore
from pdserve.server.streaming import sse, sse_response, unless_disconnected
from pdserve.server.structured import check_grammar, json_spec

router = APIRouter()


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses


# ---- the request as a chat conversation

def _input_messages(items: list[InputItem] | str) -> list[dict]:
    """`input` as chat messages in the template's shape. Consecutive function_call items join the
    assistant message before them (an answer's text and its calls are one chat message); a
    reasoning item's text is the next assistant message's reasoning_content (under both names, as
    chat's messages give it to the template, which decides whether to show it)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    thought = None   # a reasoning item's text, waiting for its assistant message

    def assistant(message: dict) -> dict:
        nonlocal thought
        if thought is not None:
            message.update(reasoning.message_fields(thought))
            thought = None
        return message

    for item in items:
        if item.type == "message":
            message = {"role": item.role, "content": join_text(item.content)}
            messages.append(assistant(message) if item.role == "assistant" else message)
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and thought is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": join_text(item.output)})
        else:   # reasoning: its text, else its summary
            text = join_text(item.content) or join_text(item.summary)
            if text:
                thought = text if thought is None else thought + "\n" + text
    return messages


def _tool_plan(body: ResponsesRequest, parser_name: str | None, harmony: bool) -> tool_calls.ToolPlan:
    """The chat path's tool plan, from the Responses API's flat tool and tool_choice shapes."""
    tools = [tool_calls.Tool(type="function", function=tool_calls.FunctionDef(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in body.tools or []]
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = tool_calls.NamedToolChoice(type="function", function=tool_calls.NamedFunction(name=choice.name))
    return tool_calls.plan(SimpleNamespace(tools=tools, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls),
                           parser_name, harmony)


def _format_grammar(body: ResponsesRequest) -> GrammarSpec | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object", param="text")
    if fmt.schema_ is None:
        raise RequestError("text.format of type json_schema needs a schema", param="text")
    return json_spec(fmt.schema_, "text")


def reasoning_effort(body: ResponsesRequest) -> str | None:
    """`reasoning.effort` (gpt-oss's, rendered by harmony); its other fields are not served."""
    if body.reasoning is None:
        return None
    effort = body.reasoning.get("effort")
    if set(body.reasoning) - {"effort"} or effort not in (None, "low", "medium", "high"):
        raise RequestError('reasoning: only "effort" ("low", "medium" or "high") is supported', param="reasoning")
    return effort


# ---- what the answer is

def _as_assistant_message(items: list[dict]) -> dict | None:
    """The output as the chat message a next turn's template gets: its text, calls and reasoning
    (which the template shows or drops, as chat's reasoning_content)."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    thoughts = [i["content"][0]["text"] for i in items if i["type"] == "reasoning"]
    if not text and not calls and not thoughts:
        return None
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}),
            **(reasoning.message_fields("\n".join(thoughts)) if thoughts else {})}


def _reasoning_tokens(s: ServerState, items: list[dict]) -> int:
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "reasoning")
    return len(s.tokenizer.encode(text, add_special_tokens=False)) if text else 0


# ---- the endpoint

class _Turn:
    """One request's answer in the making: what the response object repeats of the request, and
    the conversation to store when it completes."""

    def __init__(self, s: ServerState, store: ResponseStore, body: ResponsesRequest, history: list[dict],
                 prompt: list[int], params, think: str | None):
        self.s, self.store, self.body, self.history, self.prompt = s, store, body, history, prompt
        self.think = think   # where the prompt leaves a reasoning model (reasoning.py); None: no parser
        self.id = new_id("resp")
        self.created = int(time.time())
        self.sampling = params

    def response(self, status: str, items: list[dict], out: RequestOutput | None = None,
                 error: dict | None = None) -> dict:
        b, p = self.body, self.sampling
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        res = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "error": error,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
               "model": self.s.config.served_model_name, "output": items,
               "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": b.previous_response_id,
               "reasoning": None, "store": b.store, "temperature": p.temperature, "top_p": p.top_p,
               "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
               "tool_choice": _echo_choice(b), "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
               "truncation": "disabled", "metadata": b.metadata or {}, "usage": None}
        if out is not None:
            n_out = len(out.token_ids)
            res["usage"] = {"input_tokens": len(self.prompt),
                            # the prefix cache keeps every prompt's blocks without being asked:
                            # there are no explicit cache writes (OpenAI's cache_write_tokens) to count
                            "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                                     "cache_write_tokens": 0},
                            "output_tokens": n_out,
                            "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(self.s, items)},
                            "total_tokens": len(self.prompt) + n_out}
            res["completed_at"] = int(time.time())
            res["metrics"] = out.metrics.as_dict()   # pdserve's extension, as each chat choice's
        return res

    def finished(self, items: list[dict]) -> None:
        """Keep the conversation for previous_response_id (or remember that it was not kept)."""
        if not self.body.store:
            self.store.not_stored(self.id)
            return
        reply = _as_assistant_message(items)
        self.store.put(self.id, self.history + ([reply] if reply else []))


def _echo_choice(b: ResponsesRequest):
    if b.tool_choice is None:
        return "auto" if b.tools else "none"
    return b.tool_choice if isinstance(b.tool_choice, str) else b.tool_choice.model_dump()


def _status(out: RequestOutput) -> str:
    return "incomplete" if out.finish_reason == "length" else "completed"


def _last_item_status(plan: tool_calls.ToolPlan, items: list[dict], status: str) -> str:
    # "required" gives only the calls that were whole when the length cut the answer
    return "completed" if plan.mode == "required" and items and items[-1]["type"] == "function_call" else status


# The chat machinery names chat's fields; a refusal names the Responses API's own.
_RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}


@contextlib.contextmanager
def _responses_names():
    try:
        yield
    except RequestError as e:
        if type(e) is not RequestError or e.param not in _RENAMED:
            raise
        raise RequestError(str(e).replace(e.param, _RENAMED[e.param], 1), param=_RENAMED[e.param]) from None


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    arrival = time.perf_counter()
    with _responses_names():
        turn, sub, plan = await _admit(body, request, arrival)
    if body.stream:
        return sse_response(_events(turn, sub, plan))
    return await unless_disconnected(request, _respond(turn, sub, plan))


async def _admit(body: ResponsesRequest, request: Request, arrival: float):
    """Checks, the prompt and the engine request: what chat's handler does, from this body."""
    s = get_state(request)
    store = store_of(request)
    s.check_model(body.model)
    refuse_unsupported(body)
    s.check_queue(1, "input")   # before the template and the tokenizer: a full queue is refused at once
    if body.max_output_tokens is not None:
        s.check_cost(1, body.max_output_tokens, None)
    history = store.conversation(body.previous_response_id) if body.previous_response_id is not None else []
    history += _input_messages(body.input)
    if not history:
        raise RequestError("input must not be empty", param="input")
    harmony = s.reasoning is not None and s.reasoning.harmony
    plan = _tool_plan(body, getattr(s.config, "tool_call_parser", None), harmony)
    # a tool_choice that forces calls makes the answer calls alone: text.format has no text to shape
    grammar = plan.grammar if plan.grammar is not None else _format_grammar(body)
    await check_grammar(s.engine, grammar)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    messages = [tool_calls.template_message(m) for m in messages]
    extra = reasoning.check_template_kwargs(body.chat_template_kwargs)
    if plan.tools:
        extra["tools"] = plan.tools
    prompt = await render_prompt(s, messages, extra, reasoning_effort(body), "reasoning")
    if not prompt:
        raise RequestError("input renders to an empty prompt", param="input")
    think, extra_params = await reasoning_start(s, messages, extra, grammar)
    s.check_prompt_len([prompt], param="input")
    room = s.max_seq_len - len(prompt)   # chat's default: as much as can be served
    max_tokens = s.request_max_tokens(body.max_output_tokens, room, 1, None, room=room)
    kw = {k: v for k, v in (("temperature", body.temperature), ("top_p", body.top_p)) if v is not None}
    params = s.sampling_params(1, None, max_tokens=max_tokens, final_only=not body.stream, grammar=grammar,
                               **extra_params, **kw)
    _, sub = await s.submit([prompt], params, arrival, "resp")
    return _Turn(s, store, body, history, prompt, params[0], think), sub, plan


async def _respond(turn: _Turn, sub, plan) -> JSONResponse:
    out = (await sub.collect())[0]
    builder = OutputBuilder()
    for delta in message_deltas(answer_fields(turn.s, plan, turn.think, out)):
        builder.feed(delta)
    status = _status(out)
    builder.finish(_last_item_status(plan, builder.items, status))
    turn.finished(builder.items)
    return JSONResponse(turn.response(status, builder.items, out))


def _event(event: dict, seq: int) -> str:
    return f"event: {event['type']}\n" + sse({**event, "sequence_number": seq})


async def _events(turn: _Turn, sub, plan):
    """The Responses stream: response.created and .in_progress, the output items' events as the
    answer grows, then response.completed (or .incomplete when max_output_tokens cut it). A failure
    after the 200 was sent (a failed engine step, --request-timeout) is an `error` event and then
    response.failed. A client that leaves aborts the request (sub.cancel)."""
    seq = 0
    builder, answer = OutputBuilder(), AnswerStream(turn.s, plan, turn.think)
    try:
        for kind in ("response.created", "response.in_progress"):
            yield _event({"type": kind, "response": turn.response("in_progress", [])}, seq)
            seq += 1
        final = None
        async for out in sub.outputs():
            for delta in answer.feed(out):
                for event in builder.feed(delta):
                    yield _event(event, seq)
                    seq += 1
            if out.finished:
                final = out
        status = _status(final)
        for event in builder.finish(_last_item_status(plan, builder.items, status)):
            yield _event(event, seq)
            seq += 1
        turn.finished(builder.items)
        yield _event({"type": f"response.{status}", "response": turn.response(status, builder.items, final)}, seq)
    except APIError as e:
        code = e.code if isinstance(e.code, str) else e.type   # pdserve's: request_timeout, engine_error, ...
        yield _event({"type": "error", "code": code, "message": e.message, "param": e.param}, seq)
        # a response's error code is one of OpenAI's few; pdserve's own goes in its type
        error = {"code": "server_error" if e.status >= 500 else "invalid_prompt", "message": e.message,
                 "param": e.param, "type": code}
        yield _event({"type": "response.failed", "response": turn.response("failed", builder.items, error=error)},
                     seq + 1)
    finally:
        sub.cancel()   # a no-op unless the client left early
