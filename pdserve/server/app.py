"""The FastAPI app around one engine: routes, error format, request checks, lifespan."""
import contextlib

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline

from pdserve.server import openai_api, origin_api, responses_api, utility_api, web
from pdserve.server.async_engine import EngineThread
from pdserve.server.errors import install_error_handlers
from pdserve.server.middleware import (APIKeyMiddleware, BodyMiddleware, HostCheckMiddleware,
                                       InternalErrorMiddleware)
from pdserve.server.openapi import install_openapi
from pdserve.server.responses_store import ResponseStore
from pdserve.server.admission import ServerState
from pdserve.server.config import ServerConfig


def build_app(engine, config: ServerConfig, engine_thread: EngineThread | None = None) -> FastAPI:
    """engine_thread: the thread that built the engine, to step it on (None: a new one)."""
    state = ServerState(engine, config, engine_thread)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.async_engine.start()   # needs the running event loop
        yield
        state.async_engine.stop()
        state.close()
        if state.paged is not None:   # the KV listener of a prefill worker
            state.paged.close()

    # FastAPIOffline: /docs loads Swagger UI from this server, not a CDN (web.py serves /redoc).
    app = FastAPIOffline(title="pdserve", version=state.version, lifespan=lifespan, static_url="/static/docs",
                         redoc_url=None)
    app.state.pdserve = state
    app.state.responses = ResponseStore(config.max_stored_responses)   # previous_response_id
    for module in (openai_api, responses_api, origin_api, utility_api):
        app.include_router(module.router)
    web.install(app)   # the page at / and /v1/engine/steps
    install_error_handlers(app)
    install_openapi(app, state)
    # The last added runs first: the Host, then CORS (a preflight carries no key), the key, the body.
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(BodyMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                           allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)
    if config.allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=config.allowed_hosts)
    return app
