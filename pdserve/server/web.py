"""The web page at / (a playground and a live view of the engine's steps) and the step stream it reads.

The page is plain HTML, CSS and JavaScript in static/, served from here: no CDN, no build step.
"""
import functools
from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from pdserve.server.admission import ServerState, get_state
from pdserve.server.step_events import RING_SIZE
from pdserve.server.streaming import sse, sse_response

STATIC = Path(__file__).parent / "static"

router = APIRouter()


# The browser may fetch images, fonts and data only from this server.
REDOC_CDN_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"
OFFLINE_CSP = {"Content-Security-Policy": "img-src 'self' data:; font-src 'self' data:; connect-src 'self'"}


@router.get("/", include_in_schema=False)
async def index():
    return FileResponse(STATIC / "index.html", headers=OFFLINE_CSP)


@router.get("/redoc", include_in_schema=False)
async def redoc():
    page = get_redoc_html(openapi_url="/openapi.json", title="pdserve - ReDoc", with_google_fonts=False,
                          redoc_js_url="/redoc/redoc.standalone.js", redoc_favicon_url="/static/docs/favicon.png")
    page.headers.update(OFFLINE_CSP)
    return page


@functools.cache
def _offline_redoc_js() -> bytes:
    """fastapi-offline's ReDoc bundle without its one outside address: the sidebar's logo, which
    the bundle asks a CDN for (CSP blocks the load, but the browser still tries and logs it). An
    empty data: URL fails to load, and ReDoc then hides the image."""
    bundle = (Path(fastapi_offline.__file__).parent / "static" / "redoc.standalone.js").read_bytes()
    return bundle.replace(REDOC_CDN_LOGO, b"data:,")


@router.get("/redoc/redoc.standalone.js", include_in_schema=False)
async def redoc_js():
    return Response(_offline_redoc_js(), media_type="text/javascript")


def engine_config(s: ServerState) -> dict:
    """What the live view draws against: the step budget, the sequence cap, the KV cache's size."""
    c = s.engine.config
    limits = dict(max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
                  max_prefill_tokens_with_decodes=c.max_prefill_tokens_with_decodes, block_size=c.block_size)
    return {"model": s.config.served_model_name, "backend": s.engine.name,
            "max_model_len": s.max_model_len, **limits, "ring_size": s.step_events.ring_size}


# Streams that end only when the client leaves: a schema fuzzer must not call them (it would wait forever).
ENDLESS_STREAMS = ("/v1/engine/steps",)


@router.get("/v1/engine/steps", response_class=StreamingResponse, responses={200: {
    "description": "an endless stream: `config`, then one `step` event per engine step",
    "content": {"text/event-stream": {}}}})
async def engine_steps(request: Request, history: int = Query(0, ge=0, le=RING_SIZE,
                                                              description="past steps to send first")):
    """Server-sent events: `config` once, then one `step` event per engine step (docs/API.md)."""
    s = get_state(request)
    return sse_response(s.step_events.subscribe(history, greeting="event: config\n" + sse(engine_config(s))))


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
