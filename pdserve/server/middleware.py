"""Checks that run before a request reaches a handler: the Host header, the API key, the
Content-Type, the body (size, and text that is not Unicode), and a last catch for bugs.

Plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, which wraps `receive`
and would hide the client's disconnect from the handlers. Each refusal is in OpenAI's error
format and leaves a keep-alive connection open, except the 413 (its body was not read).
"""
import hmac
import json
import logging
import re

from fastapi.responses import JSONResponse

from pdserve.server.errors import error_body

log = logging.getLogger("pdserve.server")

# Open even with --api-key: probes and scrapers carry no key, and these reveal no data. So are
# the web page, the API docs and their files (a browser cannot send the key to load them); the
# page asks for the key and sends it with its API calls.
OPEN_PATHS = {"/health", "/metrics", "/version", "/", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
OPEN_PREFIXES = ("/static/",)


async def _refuse(scope, receive, send, status: int, message: str, code: str, param: str | None = None,
                  type: str = "invalid_request_error", headers: dict | None = None) -> None:
    await JSONResponse(error_body(message, type=type, param=param, code=code), status_code=status,
                       headers=headers)(scope, receive, send)


def _headers(scope, name: bytes) -> list[bytes]:
    return [v for k, v in scope["headers"] if k == name]


def host_name(host: bytes) -> str:
    """The name in a Host header, without the port ("[::1]:8000" -> "::1")."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class HostCheckMiddleware:
    """400 for a Host header not in --allowed-hosts: a web page that rebinds its own DNS name
    to 127.0.0.1 still sends that name, so it cannot talk to a local server."""

    def __init__(self, app, allowed_hosts: list[str]):
        self.app = app
        self.allowed = {h.lower().strip("[]") for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            hosts = _headers(scope, b"host")
            if len(hosts) > 1 or (hosts and host_name(hosts[0]) not in self.allowed):
                shown = hosts[0].decode("latin-1")[:100] if len(hosts) == 1 else f"{len(hosts)} Host headers"
                await _refuse(scope, receive, send, 400, f"Host `{shown}` is not allowed (--allowed-hosts)",
                              code="invalid_host")
                return
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")   # (a lifespan scope has none)
        if scope["type"] == "http" and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            given = _headers(scope, b"authorization")
            if len(given) > 1:   # which one a proxy or the server would read is ambiguous: neither
                await _refuse(scope, receive, send, 400, "send one Authorization header, not several",
                              code="invalid_api_key")
                return
            scheme, _, token = given[0].strip().partition(b" ") if given else (b"", b"", b"")
            # the scheme is case-insensitive (RFC 7235); the key is compared in constant time
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                await _refuse(scope, receive, send, 401, "missing or invalid API key (send `Authorization: "
                              "Bearer <key>`)", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


# A \uD800-\uDFFF escape: the only way a lone surrogate gets into a JSON body (UTF-8 cannot carry one).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(value, path: tuple = ()) -> tuple | None:
    """The path of the first string (key or value) in parsed JSON that is not valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and lone_surrogate(key) is not None:
            return path + (key,)
        found = lone_surrogate(item, path + (key,))
        if found is not None:
            return found
    return None


class BodyMiddleware:
    """For a request with a body: 415 unless it is JSON (a POST with neither a body nor a content
    type passes), 413 over `max_bytes` (without reading more than that), 400 for bytes that are not
    UTF-8 or a string that is not Unicode (tokenizers and the JSON encoder of the response would
    raise on it).

    A cross-site form post needs no CORS preflight but cannot send `application/json`, so
    requiring it keeps web pages from posting to a local server. The body is read here in full
    (it is small by construction) and replayed to the app; after it, the app's `receive` is the
    client's again, so disconnects still arrive."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # a POST without a content type may still come without a body (vLLM's clients call
        # /reset_prefix_cache so); one that carries a body is refused below
        bodiless_ok = False
        if scope["method"] in ("POST", "PUT", "PATCH"):
            types = _headers(scope, b"content-type")
            media = types[0].split(b";")[0].strip().lower() if len(types) == 1 else b""
            if media != b"application/json":
                if not types:
                    bodiless_ok = True
                else:
                    await self._not_json(scope, receive, send, types)
                    return
        length = _headers(scope, b"content-length")
        if length and length[0].isdigit() and int(length[0]) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":   # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        if bodiless_ok and body:
            await self._not_json(scope, receive, send, [])
            return
        if not body.isascii():   # (ASCII, the usual body, is UTF-8: no decoded copy made for it)
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:   # json.loads would pass it on with lone surrogates in its strings
                await _refuse(scope, receive, send, 400, f"the body is not valid UTF-8 (byte {e.start}: "
                              f"{e.reason})", code="invalid_unicode")
                return
        if _SURROGATE_ESCAPE.search(body):
            path = self._surrogate_path(body)
            if path is not None:
                shown = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
                await _refuse(scope, receive, send, 400, f"{shown or 'body'}: contains a lone UTF-16 surrogate "
                              "(a \\ud800-\\udfff escape without its pair), which is not Unicode text",
                              param=str(path[0]) if path else None, code="invalid_unicode")
                return

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)

    @staticmethod
    def _surrogate_path(body: bytes) -> tuple | None:
        try:
            parsed = json.loads(body)
        except ValueError:   # not JSON: the handler's validation says so
            return None
        return lone_surrogate(parsed)

    @staticmethod
    async def _not_json(scope, receive, send, types: list[bytes]):
        shown = types[0].decode("latin-1")[:100] if len(types) == 1 else "none" if not types else "several"
        await _refuse(scope, receive, send, 415, f"the body must be JSON: send `Content-Type: "
                      f"application/json` (got {shown})", code="unsupported_media_type")

    async def _too_large(self, scope, receive, send):
        await _refuse(scope, receive, send, 413, f"request body is larger than the limit of {self.max_bytes} bytes "
                      "(--max-body-bytes)", code="request_too_large", headers={"Connection": "close"})


class InternalErrorMiddleware:
    """A bug in a handler becomes a 500 in OpenAI's format, and the connection stays open.

    Starlette's own catch-all (ServerErrorMiddleware) re-raises after its 500, and uvicorn then
    closes the connection, so a keep-alive client's next request would fail too. Once a
    response has started (a stream) it cannot be replaced: then the connection must close."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:
                raise
            log.exception("internal error on %s", scope["path"])
            await _refuse(scope, receive, send, 500, f"internal server error: {type(e).__name__}: {e}",
                          code=None, type="server_error")
