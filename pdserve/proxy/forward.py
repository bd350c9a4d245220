"""The requests any decode worker answers alike (the model list, the tokenizer), forwarded to one.

Only fixed paths are forwarded: the upstream URL is a worker's base URL and a path named here,
never a path the client sent, so no client path can reach a worker's other routes (its
/v1/engine/steps, /metrics, /v1/kv_transfer). A forwarded answer must arrive whole within
--read-timeout and be at most `max_bytes`, so no worker answer is a never-ending read; the
caller cancels the call when its client leaves, which closes the worker connection at once.
"""
import asyncio
import json

import httpx
from fastapi.responses import JSONResponse, Response

from pdserve.proxy.relay import Refused, WorkerFailure, failure
from pdserve.server.errors import APIError

PATHS = ("/v1/models", "/tokenize", "/detokenize")
# of the largest request body: a /tokenize answer holds at worst an id and a comma per prompt byte
ANSWER_PER_BODY_BYTE = 16


class TooLarge(Exception):
    pass


class Forwarder:
    def __init__(self, proxy, max_bytes: int):
        self.proxy, self.max_bytes = proxy, max_bytes
        self.stopping = asyncio.Event()   # set when the proxy's --shutdown-timeout has run out

    async def __call__(self, method: str, path: str, content: bytes, headers: dict) -> Response:
        assert path in PATHS, path
        worker = self.proxy.decode.choose()
        timeout = self.proxy.read_timeout
        read = asyncio.ensure_future(self._read(worker, method, path, content, headers))
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            done, _ = await asyncio.wait({read, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:   # also when the caller is cancelled (its client left): the worker connection closes now
            stop.cancel()
            read.cancel()
            await asyncio.wait({read})
        try:
            if read not in done and stop in done:
                raise WorkerFailure(503, "shutdown_timeout", f"the proxy shut down before {worker} answered",
                                    "cancelled")
            if read not in done:
                raise WorkerFailure(504, "worker_timeout", f"{worker} did not answer within {timeout:g} s "
                                    "(--read-timeout)", "timeout")
            status, body, response_headers = read.result()
        except httpx.HTTPError as e:
            return failure(worker, e, timeout).response()
        except TooLarge:
            return WorkerFailure(502, "worker_failed", f"{worker} answered more than {self.max_bytes} bytes",
                                 "broken").response()
        except WorkerFailure as f:
            return f.response()
        if status != 200:
            return Refused(status, body, response_headers).response()
        return Response(body, media_type=response_headers.get("content-type", "application/json"))

    async def _read(self, worker, method: str, path: str, content: bytes, headers: dict):
        """(status, body, headers) of the worker's answer, read up to max_bytes."""
        async with self.proxy.client.stream(method, worker.url + path, content=content, headers=headers) as r:
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > self.max_bytes:
                    raise TooLarge()
            return r.status_code, bytes(body), dict(r.headers)

    async def model(self, model: str, headers: dict) -> Response:
        """GET /v1/models/{model}: the worker's card of that id, picked from its model list (so
        the id, whatever it holds, is compared, never put in a URL)."""
        response = await self("GET", "/v1/models", b"", headers)
        if response.status_code != 200:
            return response
        try:
            cards = json.loads(response.body)["data"]
        except (ValueError, KeyError, TypeError):
            return WorkerFailure(502, "bad_worker_response", "a decode worker's model list is not "
                                 "OpenAI's list object", "broken").response()
        for card in cards:
            if isinstance(card, dict) and card.get("id") == model:
                return JSONResponse(card)
        served = ", ".join(f"`{c.get('id')}`" for c in cards if isinstance(c, dict))
        raise APIError(404, f"The model `{model}` does not exist; this server serves {served}", param="model",
                       code="model_not_found")
