"""Every error leaves the server in OpenAI's format:

    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}

FastAPI's own 422 for a body that fails validation becomes a 400 that names the field; any
other exception becomes a 500 in middleware.InternalErrorMiddleware.
"""
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pdserve.errors import RequestError, SLOUnattainable

class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


class Overloaded(APIError):
    """The waiting queue is full: the client should come back soon."""

    def __init__(self, message: str, code: str = "queue_full"):
        super().__init__(503, message, type="server_error", code=code, headers={"Retry-After": "1"})


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    # a message quoting the client's text must still encode as UTF-8 (a lone surrogate would not)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


# pydantic puts the member type of a union into the location ("prompt", "list[int]"); it is not a field.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


def _field_path(loc: tuple) -> list:
    return [p for p in loc[1:] if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)]


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for the first pydantic error of a request body."""
    err = errors[0]
    if err["type"] == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"request body is not valid JSON: {detail} (at character {err['loc'][-1]})", None
    path = _field_path(tuple(err["loc"]))
    if not path:
        return f"request body must be a JSON object matching the schema: {err['msg']}", None
    shown = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    ctx_error = (err.get("ctx") or {}).get("error")
    msg = str(ctx_error) if err["type"] == "value_error" and ctx_error is not None else err["msg"]
    return f"{shown}: {msg}", str(path[0])


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        message, param = validation_message(list(e.errors()))
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(SLOUnattainable)
    async def _unattainable(request: Request, e: SLOUnattainable):
        # refused at once rather than served late (--slo-admission reject); a retry may fare better
        return error_response(APIError(503, f"request refused: {e}", type="server_error", param=e.param,
                                       code="slo_unattainable"))

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        return error_response(APIError(400, str(e), param=e.param))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        type = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(APIError(e.status_code, str(e.detail), type=type, code=e.status_code,
                                       headers=getattr(e, "headers", None)))
