"""The one HTTP endpoint in front of the engine replicas: it forwards every request, as it came, to
a replica through a Serve DeploymentHandle, and streams the replica's response back.

For the completions and chat endpoints it first computes the prompt's block hashes for the KV-aware
request router, rendered as the replicas' server renders the prompt (routing.PromptHasher);
anything it cannot read is forwarded with no hashes and gets the replica's own 400. A replica that dies before the
response began is a 503 `replica_failed`, or, with retry_failed, the request is sent again (another
replica gets it: Serve drops the dead one); one that dies mid-stream ends the stream with an error
event, as the server's own failures do."""
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdserve.proxy.relay import WorkerFailure
from pdserve.routing import PromptHasher
from pdserve.server.streaming import DONE

log = logging.getLogger("pdserve.ray")

ROUTED = {"/v1/completions", "/v1/chat/completions"}
# not copied from the replica's response: the ingress's own server sets them
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"date", b"server"}


def replica_failed(what: str) -> WorkerFailure:
    return WorkerFailure(503, "replica_failed", f"the replica serving this request failed: {what}", "unavailable")


class Ingress:
    def __init__(self, engines, model: str, block_size: int, retry_failed: bool = False, max_attempts: int = 3,
                 reasoning_parser: str | None = None):
        from pdserve.tokenizer import Tokenizer
        self.engines = engines   # DeploymentHandle of the EngineReplica deployment
        self.hasher = PromptHasher(Tokenizer.from_dir(model), block_size, reasoning_parser)
        self.retry_failed = retry_failed
        self.max_attempts = max_attempts

    def block_hashes(self, path: str, body: bytes) -> list[int]:
        """The prompt's block hashes, or [] when the body is not one the router can read."""
        if path not in ROUTED:
            return []
        try:
            return self.hasher(path, json.loads(body))
        except ValueError:   # not JSON: the replica answers it with the precise 400
            return []

    async def forward(self, request: Request):
        body = await request.body()
        path = request.url.path
        call = (request.method, path, request.url.query.encode(), list(request.scope["headers"]), body)
        try:
            opened = await self.open(self.engines, call, self.block_hashes(path, body))
        except WorkerFailure as f:
            return f.response()
        return self.respond(*opened)

    async def open(self, engines, call: tuple, hashes: list[int]):
        """(stream, head, first) of `call` on a replica of the `engines` handle's deployment: the
        replica's generator, its {"status", "headers"} and its first body chunk (a plain response's
        whole body). A replica that fails before that is replica_failed (503), or per retry_failed
        the call goes again (Serve routes it to another replica: it drops the dead one)."""
        attempts = self.max_attempts if self.retry_failed else 1
        for attempt in range(attempts):
            stream = engines.options(stream=True).forward.remote(*call, block_hashes=hashes)
            try:
                head = await stream.__anext__()
                first = await anext(stream, b"")
            except Exception as e:   # the replica died (RayActorError) or could not be reached
                stream.cancel()
                log.warning("replica failed before responding (attempt %d of %d): %r", attempt + 1, attempts, e)
                error = e
                continue
            except BaseException:   # cancelled: the client left
                stream.cancel()
                raise
            return stream, head, first
        raise replica_failed(type(error).__name__)

    def respond(self, stream, head: dict, first: bytes, extra: dict | None = None) -> StreamingResponse:
        """The client's response: the replica's status and headers (and `extra`), its body relayed."""
        headers = {k.decode(): v.decode() for k, v in head["headers"] if k.lower() not in HOP_HEADERS}
        sse_stream = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._rest(stream, first, sse_stream), status_code=head["status"],
                                 headers={**headers, **(extra or {})})

    @staticmethod
    async def _rest(stream, first: bytes, sse_stream: bool):
        try:
            if first:
                yield first
            async for chunk in stream:
                yield chunk
        except Exception as e:   # the replica died mid-response: say so, as the server's own errors do
            log.warning("replica failed mid-response: %r", e)
            if sse_stream:
                yield replica_failed(type(e).__name__).event()
                yield DONE.encode()
        finally:
            stream.cancel()   # the client left: the replica's app sees the disconnect and aborts


def ingress_class():
    """Ingress as a Serve FastAPI ingress: one catch-all route. Made here, not at import: Serve binds
    the route to the class on the driver, and a class made in a function travels to the replica as
    it is (by value), where a module-level one would be imported fresh there, unbound."""
    from ray import serve
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)   # the replicas serve /docs

    @serve.ingress(app)
    class RayIngress(Ingress):
        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
        async def route(self, request: Request):
            return await self.forward(request)

    return RayIngress
