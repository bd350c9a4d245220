"""Tool calling on chat completions: `tools` go to the chat template; `tool_choice` decides how
the answer becomes OpenAI's `tool_calls`.

- "none": the tools are not offered (nor given to the template); the answer is content.
- "auto" (the default with tools): free generation, parsed by --tool-call-parser.
- "required": the grammar allows only a JSON list of calls to declared tools, each with
  arguments valid for its schema (as vLLM does), so the answer always parses; at most
  MAX_CALLS calls (one without parallel_tool_calls), so the list closes and the answer ends
  even on a model that would add calls until the context is full.
- a named function: the grammar allows only that function's arguments.
"""
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from pdserve.engine.grammar import GrammarSpec
from pdserve.errors import RequestError
from pdserve.server.tool_parsers import PARSERS, ToolParser

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_CALLS = 8   # per answer with parallel_tool_calls (the default): docs/API.md


class FunctionDef(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(BaseModel):
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


@dataclass(frozen=True)   # NO_TOOLS is shared by every request
class ToolPlan:
    mode: str                          # "none", "auto", "required", "named"
    tools: list[dict] = field(default_factory=list)   # what the chat template gets
    name: str | None = None            # the named function
    parser: ToolParser | None = None   # auto only
    grammar: GrammarSpec | None = None


def offered(body) -> list[dict]:
    """The tools the chat template gets: the request's, unless tool_choice is "none"."""
    if not body.tools or body.tool_choice == "none":
        return []
    return [t.model_dump(exclude_none=True) for t in body.tools]


NO_TOOLS = ToolPlan("none")


def plan(body, parser_name: str | None, harmony: bool = False) -> ToolPlan:
    """The plan for a chat request; RequestError naming tools / tool_choice if it cannot be served.
    harmony (--reasoning-parser gpt_oss): the reasoning parser finds the calls, "auto" only.
    A request that names neither tools nor tool_choice has NO_TOOLS: the handler does not ask."""
    tools, choice = body.tools or [], body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise RequestError("tool_choice needs tools", param="tool_choice")
    names = [t.function.name for t in tools]
    for n in names:
        if not _NAME.match(n):
            raise RequestError(f"tool name {n!r} must be 1-64 characters of a-z, A-Z, 0-9, _, . and -", param="tools")
    if len(set(names)) != len(names):
        raise RequestError("tool names must be unique", param="tools")
    template_tools = offered(body)
    if not template_tools:
        return ToolPlan("none")
    if harmony:
        if choice not in (None, "auto"):
            raise RequestError('with --reasoning-parser gpt_oss, tool_choice is "auto" or "none" (harmony\'s '
                               "calls are free generation, not constrained)", param="tool_choice")
        return ToolPlan("auto", template_tools)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise RequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                               f"({', '.join(names)})", param="tool_choice")
        fn = tools[names.index(choice.function.name)].function
        return ToolPlan("named", template_tools, fn.name, grammar=_json(_parameters(fn), "tools"))
    if choice == "required":
        calls = {"type": "array", "minItems": 1, "maxItems": MAX_CALLS if body.parallel_tool_calls else 1,
                 "items": {"anyOf": [
                     {"type": "object", "properties": {"name": {"const": t.function.name},
                                                       "parameters": _embedded(t.function, i)},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for i, t in enumerate(tools)]}}
        return ToolPlan("required", template_tools, grammar=_json(calls, "tools"))
    if parser_name is None:   # "auto"
        raise RequestError('tool_choice "auto" needs a server started with --tool-call-parser; "required" '
                           "or a named function work without one", param="tool_choice")
    return ToolPlan("auto", template_tools, parser=PARSERS[parser_name]())


def _parameters(fn: FunctionDef) -> dict:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


def _embedded(fn: FunctionDef, i: int) -> dict:
    """A tool's parameters as a part of the "required" schema. Its own `$id` makes it a schema
    resource of its own, so its `$ref`s (`#/$defs/...`, as pydantic writes them) resolve against
    it, not against the array around it, and two tools may each define a `$defs` entry of one name."""
    params = _parameters(fn)
    return params if "$id" in params else {"$id": f"urn:pdserve:tool:{i}", **params}


def _json(schema: dict, param: str) -> GrammarSpec:
    return GrammarSpec("json", json.dumps(schema), param)


def template_message(m: dict) -> dict:
    """An assistant message's tool_calls as templates expect them: arguments as an object."""
    calls = m.get("tool_calls")
    if calls:
        out = []
        for c in calls:
            fn = dict(c.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass   # left as the string the client sent
            out.append({**c, "function": fn})
        m = {**m, "tool_calls": out}
    return m


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def extract(p: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished answer."""
    if p.mode == "named":
        return (None, [new_call(p.name, text)]) if finish_reason == "stop" else (text, [])
    if p.mode == "required":   # never content: the calls the answer completed (all, unless cut short)
        return None, [new_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                      for c in _complete_items(text)]
    if p.mode == "auto":
        content, calls = p.parser.parse(text)
        return content, [new_call(n, a) for n, a in calls]
    return text, []


def _complete_items(text: str) -> list:
    """The items of a JSON array that are whole in `text`, a prefix of the array the grammar
    allowed (compact, as JSON_OPTIONS writes it): an item that max_tokens cut is left out."""
    items, decoder, i = [], json.JSONDecoder(), 1
    while text.startswith("[") and i < len(text):
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        items.append(item)
        i += 1   # the "," or "]" after it
    return items


class ToolStream:
    """Turns one choice's streamed text into delta dicts: content while it is surely content,
    tool-call deltas as OpenAI streams them (named: the arguments as they come; otherwise each
    call whole once the answer ends)."""

    def __init__(self, p: ToolPlan):
        self.plan = p
        self.text = ""
        self.sent = 0   # characters of text already sent as content (or as named arguments)
        self.named_started = False

    def deltas(self, new_text: str, finished: bool, finish_reason: str | None) -> list[dict]:
        self.text += new_text
        p, out = self.plan, []
        if p.mode == "named":
            if not self.named_started:
                self.named_started = True
                call = new_call(p.name, "")
                out.append({"tool_calls": [{"index": 0, **call}]})
            if new_text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]})
            return out
        if p.mode == "required":
            if finished:
                _, calls = extract(p, self.text, finish_reason)
                return [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)]
            return []
        if p.mode != "auto":
            upto = len(self.text)
        elif not finished:
            upto = p.parser.content_prefix(self.text, False)
        else:
            _, calls = extract(p, self.text, finish_reason)
            # with calls, the content is what comes before them; without, everything held back
            upto = p.parser.content_prefix(self.text, False) if calls else len(self.text)
            out += [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)]
        if upto > self.sent:
            out.insert(0, {"content": self.text[self.sent:upto]})
            self.sent = upto
        return out

    def has_calls(self) -> bool:
        if self.plan.mode in ("required", "auto"):   # a stop string may have cut "required" before its first call
            return bool(extract(self.plan, self.text, None)[1])
        return self.plan.mode == "named"
