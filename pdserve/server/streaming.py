"""Server-sent events, and noticing a client that went away.

Starlette cancels a streaming response when its client disconnects (our generators then
abort their engine requests in `finally`), but a plain handler keeps running to the end;
`unless_disconnected` gives plain handlers the same behaviour.
"""
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

DONE = "data: [DONE]\n\n"


# Characters JSON leaves raw that str.splitlines() breaks lines at: clients that read an event
# stream with it (httpx's iter_lines, requests' iter_lines) would cut an event in two.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False).translate(_LINE_BREAKS)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    # no-cache and X-Accel-Buffering stop proxies from holding tokens back
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or end of response).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable):
    """The result of `work`, or a 499 response if the client disconnects first.

    On disconnect `work` is cancelled, so its `finally` blocks abort its engine requests
    and the KV blocks are freed within one step.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:   # also when this handler itself is cancelled (shutdown timeout)
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    try:
        await task   # let its finally blocks run
    except asyncio.CancelledError:
        pass
    return Response(status_code=499)   # nginx's "client closed request"; nobody reads it
