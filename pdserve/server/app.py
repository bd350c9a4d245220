"""The FastAPI app around one engine: routes, error format, request checks, lifespan."""
import contextlib

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from pdserve.server import openai_api, origin_api, utility_api, web
from pdserve.server.async_engine import EngineThread
from pdserve.server.errors import install_error_handlers
from pdserve.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from pdserve.server.admission import ServerConfig, ServerState


def build_app(engine, config: ServerConfig, engine_thread: EngineThread | None = None) -> FastAPI:
    """engine_thread: the thread that built the engine, to step it on (None: a new one)."""
    state = ServerState(engine, config, engine_thread)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.async_engine.start()   # needs the running event loop
        yield
        state.async_engine.stop()

    # strict_content_type=False: a JSON body without a Content-Type header is still JSON.
    # FastAPIOffline: /docs loads Swagger UI from this server, not a CDN (web.py serves /redoc).
    app = FastAPIOffline(title="pdserve", lifespan=lifespan, strict_content_type=False, static_url="/static/docs",
                         redoc_url=None)
    app.state.pdserve = state
    for module in (openai_api, origin_api, utility_api):
        app.include_router(module.router)
    web.install(app)   # the page at / and /v1/engine/steps
    install_error_handlers(app)
    # The last added runs first: the key is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    return app
