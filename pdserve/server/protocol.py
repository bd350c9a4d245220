"""Request bodies of every endpoint, as pydantic models.

Pydantic checks shapes and types only; the numeric ranges of sampling fields are checked
once, by SamplingParams, so the offline LLM and the server accept exactly the same values.
Unknown fields are ignored, as OpenAI's own server does for fields it does not know.
Types are strict (_Strict): `true` is not an integer, `"5"` and `2.0` are not integers, as
the published schema says.
"""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, WithJsonSchema, field_validator

from pdserve.kv_transfer.params import KVTransferParams
from pdserve.objectives import RequestObjectives

from pdserve.server.structured import StructuredFields
from pdserve.server.reasoning import check_template_kwargs
from pdserve.server.tool_calls import ToolFields, template_message


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SLOTargets(_Strict):
    """Per-phase latency targets of one request, in milliseconds (None: the server's default)."""
    ttft_ms: StrictFloat | StrictInt | None = None
    tpot_ms: StrictFloat | StrictInt | None = None


class KVTransferFields(_Strict):
    """kv_transfer_params (vLLM's disaggregated-serving field; pdserve/kv_transfer/params.py checks
    the combinations). Other connectors' keys are ignored."""
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: StrictInt | None = None
    remote_request_id: str | None = None
    num_tokens: StrictInt | None = None
    transport: Literal["tcp", "shm"] = "tcp"
    block_size: StrictInt | None = None
    dtype: str | None = None
    decode_engine_id: str | None = None
    prompt_hash: str | None = None
    signature: str | None = None


class _SamplingFields(_Strict, StructuredFields):
    """What completions and chat share. None means "the SamplingParams default"."""
    model: str | None = None
    n: int = Field(1, ge=1)   # the upper bound is --max-n
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None   # prefix-cache isolation: only requests with the same salt share blocks
    # vLLM's priority (lower runs first; --scheduling-policy priority) and pdserve's per-phase targets
    priority: StrictInt = 0
    slo: SLOTargets | None = None
    kv_transfer_params: KVTransferFields | None = None   # prefill/decode disaggregation (docs/API.md)
    # vLLM's: each prompt token's logprob, rank and this many alternatives (docs/API.md)
    prompt_logprobs: int | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_kwargs(self) -> dict:
        """SamplingParams keyword arguments, without max_tokens, logprobs and seed (set per choice)."""
        fields = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "min_tokens", "repetition_penalty", "stop", "stop_token_ids", "cache_salt")
        kw = {f: getattr(self, f) for f in fields if getattr(self, f) is not None}
        kw.update(ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                  skip_special_tokens=self.skip_special_tokens)
        if self.priority or self.slo is not None:   # ranges checked by RequestObjectives (400 naming the field)
            slo = self.slo or SLOTargets()
            kw["objectives"] = RequestObjectives(self.priority, slo.ttft_ms, slo.tpot_ms)
        if self.kv_transfer_params is not None:   # combinations checked by KVTransferParams (400 naming the field)
            kw["kv_transfer_params"] = KVTransferParams(**self.kv_transfer_params.model_dump(exclude_none=True))
        return kw

    @property
    def remote_decode(self) -> bool:
        return self.kv_transfer_params is not None and self.kv_transfer_params.do_remote_decode

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def _nonempty_list(items: dict) -> dict:
    return {"type": "array", "minItems": 1, "items": items}


# What _prompt_shape accepts, for /openapi.json
PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1}, _nonempty_list({"type": "string"}),
                           _nonempty_list({"type": "integer"}), _nonempty_list(_nonempty_list({"type": "integer"}))]}


class CompletionRequest(_SamplingFields):
    prompt: Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)] = Field(
        ..., description="a string, a list of strings, a list of token ids or a list of them")
    max_tokens: int | None = 16   # OpenAI's default for the legacy completions endpoint; 0 only with echo
    logprobs: int | None = None
    echo: bool = False   # the prompt before the completion (with logprobs: the prompt tokens' logprobs first)

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v):
        def ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        if isinstance(v, list) and not v:
            raise ValueError("must not be an empty list")
        if isinstance(v, str) or ids(v):
            return v
        if isinstance(v, list) and (all(isinstance(p, str) for p in v) or all(ids(p) for p in v)):
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


# content parts of other modalities, as OpenAI's chat and Responses APIs spell them
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file", "input_file")


def refuse_media(content: Any) -> Any:
    """A content list with an image (audio, video, file) part is a 400 that names it: pdserve serves
    text prompts only, of vision-language checkpoints too (their text part, pdserve/vlm_text.py)."""
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise ValueError(f"content parts of type {kind} are not supported: pdserve serves text inputs "
                             "only (of a vision-language model, its text part)")
    return content


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None                   # a tool result's call
    # an assistant's earlier thinking, as a response gave it (vLLM takes both names): templates
    # such as Qwen3's read message.reasoning_content
    reasoning_content: str | None = None
    reasoning: str | None = None

    _no_media = field_validator("content", mode="before")(refuse_media)

    def as_template_dict(self) -> dict:
        # Templates expect content as one string; text parts are joined as OpenAI does.
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "\n".join(p.text for p in self.content)
        d = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.tool_calls is not None:
            d = template_message({**d, "tool_calls": self.tool_calls})
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None:
            d["reasoning_content"] = d["reasoning"] = thought
        return d


class ChatCompletionRequest(_SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = None                # deprecated by OpenAI in favour of the next one
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    continue_final_message: Any = None   # not supported: refused when given, not ignored
    # variables for the chat template, as vLLM takes them (e.g. {"enable_thinking": false} for Qwen3);
    # the ones the server sets are refused (server/reasoning.py)
    chat_template_kwargs: dict[str, Any] | None = None
    # gpt-oss's reasoning effort, rendered into harmony's system message (--reasoning-parser gpt_oss)
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def template_input(self, tools: list[dict]) -> tuple[list[dict], dict]:
        """What the chat template renders, as the engine gets it (the handler and the routers'
        prompt hashes, pdserve/routing.py, both render this): the messages, earlier tool calls'
        arguments as objects, and the template's variables: chat_template_kwargs (checked:
        RequestError) and the tools offered."""
        # a plain request (no template variables, no tools, no earlier calls) runs no code of theirs
        template_vars = check_template_kwargs(self.chat_template_kwargs) if self.chat_template_kwargs else {}
        if tools:
            template_vars["tools"] = tools
        return [m.as_template_dict() for m in self.messages], template_vars


# ---- the origin server's endpoints (field names are theirs)

class _OriginFields(_Strict):
    max_tokens: int = 64
    temperature: float = 0.0    # greedy: the origin server decoded greedily


class BasicGenerateRequest(_OriginFields):
    prompt: str


class GenerateRequest(_OriginFields):
    prompts: list[str] = Field(..., min_length=1)


class GenerateStreamRequest(_OriginFields):
    prompt: str


# ---- utilities

class TokenizeRequest(_Strict):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # only with messages
    chat_template_kwargs: dict[str, Any] | None = None   # only with messages, as chat completions take them
    add_special_tokens: bool = True     # only with prompt


class DetokenizeRequest(_Strict):
    tokens: list[int]
