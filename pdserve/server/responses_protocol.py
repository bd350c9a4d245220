"""The request body of POST /v1/responses (OpenAI's Responses API), as pydantic models.

What pdserve serves of it, and what it refuses, is in docs/API.md ("Responses"). Types are
strict, as for the other endpoints; fields OpenAI defines that pdserve cannot honour are
declared here so that a request that sets them is refused naming the field (responses_api.py,
`refuse_unsupported`), never silently ignored. Other unknown fields are ignored, as elsewhere.
"""
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, field_validator, model_validator

from pdserve.errors import RequestError
from pdserve.server.protocol import refuse_media


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, populate_by_name=True)


class ContentPart(_Strict):
    """A text part: input_text (user, system, developer) or output_text (an assistant's earlier
    answer, as the Responses API returned it) in a message or a function_call_output; reasoning_text
    and summary_text in an earlier reasoning item. Images, files and audio are not supported."""
    type: Literal["input_text", "output_text", "reasoning_text", "summary_text"]
    text: str


# the part types each place takes
_PARTS = {"content": ("input_text", "output_text"), "output": ("input_text", "output_text"),
          "reasoning": ("reasoning_text",), "summary": ("summary_text",)}


class InputItem(_Strict):
    """One item of `input`: a message (the default type, as in OpenAI's "easy" input messages), an
    earlier turn's function_call or its function_call_output, or an earlier reasoning item (its
    text goes back to the template as the next assistant message's reasoning_content, as chat's)."""
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: list[ContentPart] | str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: list[ContentPart] | str | None = None
    summary: list[ContentPart] | None = None   # a reasoning item's

    _no_media = field_validator("content", "output", mode="before")(refuse_media)

    @model_validator(mode="after")
    def _fields_of_its_type(self):
        need = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output"), "reasoning": ()}[self.type]
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"an item of type {self.type} needs {', '.join(missing)}")
        for field in ("content", "output", "summary"):
            value = getattr(self, field)
            allowed = _PARTS["reasoning" if field == "content" and self.type == "reasoning" else field]
            for part in value if isinstance(value, list) else []:
                if part.type not in allowed:
                    raise ValueError(f"the {field} of an item of type {self.type} takes parts of type "
                                     f"{' or '.join(allowed)}, not {part.type}")
        return self


def join_text(parts: list[ContentPart] | str | None) -> str:
    """A content (or output) as one string: text parts joined with newlines, as chat joins them."""
    return parts if isinstance(parts, str) else "\n".join(p.text for p in parts or [])


class FunctionTool(_Strict):
    """A function tool, in the Responses API's flat shape. Other tool types (web_search, file_search,
    mcp, ...) are a 400 naming `tools`."""
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # refused when set


class ResponsesRequest(_Strict):
    model: str | None = None
    input: list[InputItem] | str
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    stream: bool = False
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None                    # only empty
    truncation: Literal["disabled", "auto"] | None = None   # only "disabled"
    # its effort goes to harmony's system message (--reasoning-parser gpt_oss); otherwise refused
    reasoning: dict[str, Any] | None = None
    # OpenAI's, not served here: a request that sets one is refused naming it
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: StrictInt | None = None
    max_tool_calls: StrictInt | None = None
    context_management: Any = None
    # vLLM's extension, as chat's: variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None


UNSUPPORTED = ("conversation", "prompt", "top_logprobs", "max_tool_calls", "context_management")


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 naming the first field this server does not serve that the request sets."""
    for f in UNSUPPORTED:
        if getattr(body, f) is not None:
            raise RequestError(f"{f} is not supported by this server", param=f)
    if body.background:
        raise RequestError("background is not supported by this server: responses are answered while the "
                           "request waits, or streamed", param="background")
    if body.include:
        raise RequestError(f"include is not supported by this server (got {', '.join(body.include)})",
                           param="include")
    if body.truncation == "auto":
        raise RequestError('truncation "auto" is not supported: a prompt over the context is refused',
                           param="truncation")
    if body.text is not None and body.text.verbosity is not None:
        raise RequestError("text.verbosity is not supported by this server", param="text")
