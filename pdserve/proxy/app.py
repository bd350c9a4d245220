"""The proxy's FastAPI app: the OpenAI generation endpoints relayed through a prefill and a
decode worker (relay.py), the model list and tokenizer forwarded to a decode worker (forward.py),
/health over every worker, and the proxy's own /metrics. No other path reaches a worker."""
import asyncio
import contextlib
import json
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve import __version__
from pdserve.proxy.forward import ANSWER_PER_BODY_BYTE, Forwarder
from pdserve.proxy.relay import Proxy
from pdserve.server.errors import APIError, error_response, install_error_handlers
from pdserve.server.middleware import APIKeyMiddleware, BodyMiddleware, HostCheckMiddleware, InternalErrorMiddleware
from pdserve.server.streaming import unless_disconnected
from pdserve.server.metrics import CONTENT_TYPE

HEALTH_TIMEOUT_S = 2.0


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def build_app(proxy: Proxy, connect_timeout: float = 5.0, max_body_bytes: int = 1 << 20,
              allowed_hosts: list[str] | None = None, max_connections: int = 1000) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # one pooled client for every worker; a read timeout bounds each wait for bytes, not the answer
        timeout = httpx.Timeout(proxy.read_timeout, connect=connect_timeout)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            proxy.client = client
            yield

    app = FastAPI(title="pdserve proxy", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.proxy = proxy

    async def relay(request: Request, endpoint: str, path: str) -> Response:
        """`path` is the route's own: what a client sent never becomes a worker's path."""
        arrival = time.perf_counter()
        body = parse_body(await request.body())
        headers = proxy.headers_for(request.headers)
        if body.get("stream") is True:
            work = proxy.stream(path, body, headers, arrival, endpoint)
        else:
            work = proxy.complete(path, body, headers, arrival)
        return await unless_disconnected(request, proxy.answer(endpoint, work, arrival))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay(request, "completions", "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await relay(request, "chat", "/v1/chat/completions")

    forwarder = app.state.forwarder = Forwarder(proxy, max_bytes=ANSWER_PER_BODY_BYTE * max_body_bytes)

    async def forward(request: Request, method: str, path: str) -> Response:
        """A fixed `path` of a decode worker (forward.py), cancelled if the client leaves."""
        work = forwarder(method, path, await request.body(), proxy.headers_for(request.headers))
        return await unless_disconnected(request, work)

    @app.get("/v1/models")
    async def models(request: Request):
        return await forward(request, "GET", "/v1/models")

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        return await unless_disconnected(request, forwarder.model(model, proxy.headers_for(request.headers)))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await forward(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await forward(request, "POST", "/detokenize")

    @app.get("/health")
    async def health():
        """200 when every worker's /health is; otherwise 503 naming those that are not."""
        workers = proxy.prefill.workers + proxy.decode.workers

        async def status(w) -> int:
            # only the status line is read: a body, however long, is never waited for
            async with proxy.client.stream("GET", w.url + "/health", timeout=HEALTH_TIMEOUT_S) as r:
                return r.status_code

        async def probe(w) -> str:
            try:
                code = await asyncio.wait_for(status(w), HEALTH_TIMEOUT_S)
            except (httpx.HTTPError, TimeoutError) as e:
                return f"unreachable ({type(e).__name__})"
            return "ok" if code == 200 else f"HTTP {code}"
        states = dict(zip((f"{w.role} {w.url}" for w in workers), await asyncio.gather(*map(probe, workers))))
        bad = [f"{name}: {state}" for name, state in states.items() if state != "ok"]
        if bad:
            return error_response(APIError(503, "workers not healthy: " + "; ".join(bad), type="server_error",
                                           code="worker_unhealthy"))
        return JSONResponse({"status": "ok", "workers": states})

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(proxy.metrics.render(), media_type=CONTENT_TYPE)

    install_error_handlers(app)
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(BodyMiddleware, max_bytes=max_body_bytes)
    if proxy.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=proxy.api_key)
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=allowed_hosts)
    return app
