"""Checks that run before a request reaches a handler: the API key and the body size.

Plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, which wraps `receive`
and would hide the client's disconnect from the handlers.
"""
import hmac

from fastapi.responses import JSONResponse

from pdserve.server.errors import error_body

# Open even with --api-key: probes and scrapers carry no key, and these reveal no data. So are
# the web page, the API docs and their files (a browser cannot send the key to load them); the
# page asks for the key and sends it with its API calls.
OPEN_PATHS = {"/health", "/metrics", "/version", "/", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
OPEN_PREFIXES = ("/static/",)


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")   # (a lifespan scope has none)
        if scope["type"] == "http" and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):   # constant time: no timing oracle on the key
                body = error_body("missing or invalid API key (send `Authorization: Bearer <key>`)",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`, without reading more than that.

    The body is read here in full (it is small by construction) and replayed to the app;
    after it, the app's `receive` is the client's again, so disconnects still arrive.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":   # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)

    async def _reject(self, scope, receive, send):
        body = error_body(f"request body is larger than the limit of {self.max_bytes} bytes (--max-body-bytes)",
                          code="request_too_large")
        await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)
