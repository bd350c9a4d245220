"""/openapi.json as the server really answers: refusals are 400 (not FastAPI's 422) with
OpenAI's error body, every status an operation can return is declared, and streams are
text/event-stream. tests/server/test_openapi.py runs schemathesis against it."""
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pdserve.server.middleware import OPEN_PATHS

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}},
}
WHY = {400: "Bad request: a field out of range or of the wrong type (named in `param`), or a bad Host header",
       401: "Missing or invalid API key (--api-key)", 404: "Unknown model", 413: "Body over --max-body-bytes",
       415: "Body not sent as application/json", 500: "Internal error, or the engine failed this request",
       503: "Queue full (--max-waiting; Retry-After), shutting down, or the engine is not running",
       504: "Not finished within --request-timeout"}
# One server-sent event: its `data` is a JSON chunk, or [DONE] at the end.
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
GENERATION = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/basic_generate", "/generate", "/generate_stream"}
ORIGIN = {"BasicGenerateRequest", "GenerateRequest", "GenerateStreamRequest"}
STREAMS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate_stream"}


def statuses(path: str, method: str, api_key: bool) -> list[int]:
    """The error statuses one operation can answer with."""
    codes = {400, 500}
    if api_key and path not in OPEN_PATHS:
        codes.add(401)
    if method == "post":
        codes |= {413, 415}
    if path in GENERATION:
        codes |= {503, 504}
    if path in ("/v1/completions", "/v1/chat/completions", "/v1/responses") or path.startswith("/v1/models/"):
        codes.add(404)
    if path == "/health":
        codes.add(503)
    return sorted(codes)


def ranges(state) -> dict[str, dict]:
    """The bounds the server checks (SamplingParams and the launch caps), as JSON Schema keywords."""
    c = state.config
    logprobs = {"minimum": 0, "maximum": c.max_logprobs}
    # a prompt has at least one token, so max_tokens is below the context
    max_tokens = {"minimum": 1, "maximum": min(c.max_tokens_cap or state.max_model_len, state.max_model_len - 1)}
    return {
        "n": {"minimum": 1, "maximum": c.max_n}, "max_tokens": max_tokens, "max_completion_tokens": max_tokens,
        "max_output_tokens": max_tokens,
        "temperature": {"minimum": 0}, "top_p": {"exclusiveMinimum": 0, "maximum": 1}, "top_k": {"minimum": -1},
        "min_p": {"minimum": 0, "maximum": 1}, "presence_penalty": {"minimum": -2, "maximum": 2},
        "frequency_penalty": {"minimum": -2, "maximum": 2}, "repetition_penalty": {"exclusiveMinimum": 0},
        "min_tokens": {"minimum": 0}, "seed": {"minimum": -2**63, "maximum": 2**64 - 1},
        "logprobs": logprobs, "top_logprobs": logprobs, "prompt_logprobs": logprobs,
    }


def _constrain(prop: dict, bounds: dict) -> None:
    """Add bounds to a property's numeric type (inside anyOf when it is nullable)."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") in ("integer", "number"):
            branch.update(bounds)


def _constrain_lists(components: dict, state) -> None:
    """Stop strings, stop ids, token ids and origin prompts: the bounds of their items."""
    c = state.config
    stop = {"minLength": 1, "maxLength": c.max_stop_length}
    for name, component in components.items():
        props = component.get("properties", {})
        for branch in props.get("stop", {}).get("anyOf", []):
            if branch.get("type") == "string":
                branch.update(stop)
            elif branch.get("type") == "array":
                branch.update(maxItems=c.max_stop_strings)
                branch["items"].update(stop)
        for branch in props.get("stop_token_ids", {}).get("anyOf", []):
            if branch.get("type") == "array":
                branch["items"].update(minimum=0)
        if name == "DetokenizeRequest":
            props["tokens"]["items"].update(minimum=0, maximum=state.tokenizer.vocab_size - 1)
        if name in ("BasicGenerateRequest", "GenerateStreamRequest"):
            props["prompt"].update(minLength=1)
        if name == "GenerateRequest":
            props["prompts"]["items"].update(minLength=1)


def install_openapi(app: FastAPI, state) -> None:
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        components["ErrorResponse"] = ERROR_SCHEMA
        bounds = ranges(state)
        for name, component in components.items():
            for field, prop in component.get("properties", {}).items():
                if field == "max_tokens" and name in ORIGIN:   # clamped to the context there, not refused
                    _constrain(prop, {"minimum": 1, **({"maximum": state.config.max_tokens_cap}
                                                       if state.config.max_tokens_cap else {})})
                elif field == "max_tokens" and name == "CompletionRequest":   # 0 with echo: the prompt only
                    _constrain(prop, {**bounds[field], "minimum": 0})
                elif field in bounds:
                    _constrain(prop, bounds[field])
        _constrain_lists(components, state)
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, ops in schema["paths"].items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for code in statuses(path, method, bool(state.config.api_key)):
                    responses[str(code)] = {"description": WHY[code], "content": error}
                ok = responses.setdefault("200", {"description": "OK"})
                if path in STREAMS:   # "stream": true answers server-sent events
                    events = {"text/event-stream": {"schema": SSE_EVENT}}
                    ok["content"] = events if path == "/generate_stream" else {**ok.get("content", {}), **events}
                if path == "/metrics":
                    ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
        app.openapi_schema = schema
        return schema
    app.openapi = openapi
