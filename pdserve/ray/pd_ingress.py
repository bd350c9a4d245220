"""The endpoint in front of prefill and decode pools: each completion or chat request takes the
proxy's two calls (pdserve/proxy/relay.py prefill_then_decode, docs/API.md "Disaggregated
serving"), made through Serve handles instead of HTTP: a prefill replica, chosen prefix-aware
(the prompt's cached blocks live in the prefill pool), prefills the prompt and holds its KV under
a lease; a decode replica, chosen least-loaded, pulls that KV over TCP from the prefill replica's
listener and generates, and its answer goes back to the client as it comes. Ray carries the
requests and responses, never the KV.

Failures are the plain ingress's: a replica that fails before answering is a 503
`replica_failed` (or, with retry_failed, the call goes to another replica of its pool), one that
fails mid-stream ends the stream with an error event. A refusal of either worker (400, 503
overload, ...) reaches the client unchanged. Anything but the two generation endpoints (models,
tokenizer, /metrics, /v1/kv_transfer) is forwarded as it came to a decode replica.

The ingress cannot choose the decode replica before the prefill call (Serve's router places the
call), so the decode pool shares one engine id on the KV channel and a lease is made for the pool;
the ingress holds the deployment's secret to release a lease whose decode call did not go through."""
import json

from fastapi import Request

from pdserve.proxy.app import parse_body
from pdserve.proxy.relay import Refused, WorkerFailure, prefill_then_decode
from pdserve.ray.ingress import HOP_HEADERS, ROUTED, Ingress, replica_failed
from pdserve.server.errors import APIError, error_response

# request headers the ingress sets itself on the calls it makes
BODY_HEADERS = {b"content-length", b"content-type", b"transfer-encoding"}


class PDIngress(Ingress):
    def __init__(self, prefill, decode, model: str, block_size: int, retry_failed: bool = False,
                 max_attempts: int = 3, decode_engine_id: str | None = None, kv_secret: str | None = None,
                 reasoning_parser: str | None = None):
        super().__init__(decode, model, block_size, retry_failed, max_attempts, reasoning_parser)
        self.prefill = prefill   # DeploymentHandles of the prefill and the decode engine deployments
        self.decode = decode
        self.decode_engine_id, self.kv_secret = decode_engine_id, kv_secret

    async def forward(self, request: Request):
        path = request.url.path
        if request.method != "POST" or path not in ROUTED:
            return await super().forward(request)   # self.engines is the decode pool
        raw = await request.body()
        try:
            body = parse_body(raw)
        except APIError as e:
            return error_response(e)
        hashes = self.block_hashes(path, raw)
        query = request.url.query.encode()
        kept = [(k, v) for k, v in request.scope["headers"] if k.lower() not in BODY_HEADERS]

        def call(body: dict) -> tuple:
            data = json.dumps(body).encode()
            headers = kept + [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
            return "POST", path, query, headers, data

        prefilled = {}   # the prefill replica's headers, for the client's response

        async def prefill(body: dict) -> tuple[bytes, str]:
            stream, head, first = await self.open(self.prefill, call(body), hashes)
            try:
                content = first + b"".join([chunk async for chunk in stream])
            except Exception as e:   # died after its first bytes: a plain answer is one chunk, so rarely
                raise replica_failed(type(e).__name__) from None
            finally:
                stream.cancel()
            headers = {k.decode().lower(): v.decode() for k, v in head["headers"] if k.lower() not in HOP_HEADERS}
            if head["status"] != 200:
                raise Refused(head["status"], content, headers)
            replica = headers.get("x-pdserve-replica", "?")
            prefilled.update({"x-pdserve-prefill-replica": replica,
                              "x-pdserve-prefill-node": headers.get("x-pdserve-node", "?")})
            return content, f"prefill replica {replica}"

        async def decode(body: dict):
            return self.respond(*await self.open(self.decode, call(body), []), extra=prefilled)

        try:
            return await prefill_then_decode(path, body, prefill, decode, self.decode_engine_id, self.kv_secret)
        except (Refused, WorkerFailure) as e:
            return e.response()


def pd_ingress_class():
    """PDIngress as a Serve FastAPI ingress (ingress.ingress_class says why it is made here)."""
    from fastapi import FastAPI
    from ray import serve
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @serve.ingress(app)
    class RayPDIngress(PDIngress):
        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
        async def route(self, request: Request):
            return await self.forward(request)

    return RayPDIngress
