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
GENERATION = {"/v1/completions", "/v1/chat/completions", "/basic_generate", "/generate", "/generate_stream"}
STREAMS = {"/v1/completions", "/v1/chat/completions", "/generate_stream"}


def statuses(path: str, method: str, api_key: bool) -> list[int]:
    """The error statuses one operation can answer with."""
    codes = {400, 500}
    if api_key and path not in OPEN_PATHS:
        codes.add(401)
    if method == "post":
        codes |= {413, 415}
    if path in GENERATION:
        codes |= {503, 504}
    if path in ("/v1/completions", "/v1/chat/completions") or path.startswith("/v1/models/"):
        codes.add(404)
    if path == "/health":
        codes.add(503)
    return sorted(codes)


def install_openapi(app: FastAPI, state) -> None:
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        components["ErrorResponse"] = ERROR_SCHEMA
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
