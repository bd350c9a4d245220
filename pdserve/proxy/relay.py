"""One request through the proxy: the prefill call (one token, the prompt's KV kept under a
lease), then the decode call with the `kv_transfer_params` the prefill worker returned, whose
answer goes back to the client unchanged.

A worker's own refusal (4xx, or a 5xx it chose to send) passes through as it is. A worker the
proxy cannot reach is a 503, one that sends nothing for --read-timeout a 504, one that breaks off
its answer a 502, each in OpenAI's error format; a stream that is already under way ends with an
error event and `[DONE]`, as pdserve's own streams end on an error. A client that leaves cancels
the call in progress: the worker sees its connection close and aborts the request (a decode
worker then releases the prefill worker's lease).

The decode worker is chosen before the prefill call, which makes the lease for it alone
(`decode_engine_id`). Once the prefill worker has answered, the lease is this proxy's to end
until the decode worker has accepted the call: if the decode call is refused, fails, or its
client leaves first, the proxy releases the lease itself on the KV channel (with the
deployment's secret, --kv-transfer-secret), so it is freed at once, not after --kv-lease-s.
"""
import asyncio
import json
import logging
import time

import httpx
from fastapi.responses import Response, StreamingResponse

from pdserve.kv_transfer import auth, tcp
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.workers import Pool, Worker
from pdserve.server.errors import APIError, error_body, error_response
from pdserve.server.streaming import DONE, sse

log = logging.getLogger("pdserve.proxy")
PASSED_HEADERS = ("content-type", "retry-after", "www-authenticate")   # of a worker's refusal
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class WorkerFailure(Exception):
    """A worker that could not be reached, said nothing in time, or broke off its answer."""

    def __init__(self, status: int, code: str, message: str, outcome: str):
        super().__init__(message)
        self.status, self.code, self.message, self.outcome = status, code, message, outcome

    def response(self) -> Response:
        return error_response(APIError(self.status, self.message, type="server_error", code=self.code))

    def event(self) -> bytes:
        return sse(error_body(self.message, "server_error", None, self.code)).encode()


class Refused(Exception):
    """A worker answered with an error of its own: the client gets it unchanged."""

    def __init__(self, status: int, body: bytes, headers: dict):
        self.status, self.body = status, body
        self.headers = {k: v for k, v in headers.items() if k.lower() in PASSED_HEADERS}

    @classmethod
    def of(cls, response: httpx.Response) -> "Refused":
        return cls(response.status_code, response.content, dict(response.headers))

    def response(self) -> Response:
        return Response(self.body, status_code=self.status, headers=self.headers)


def failure(worker: Worker, e: httpx.HTTPError, read_timeout: float) -> WorkerFailure:
    detail = str(e) or type(e).__name__
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return WorkerFailure(503, "worker_unavailable", f"{worker} is unreachable: {detail}", "unavailable")
    if isinstance(e, httpx.PoolTimeout):
        return WorkerFailure(503, "worker_unavailable", f"no free connection to {worker}", "unavailable")
    if isinstance(e, httpx.TimeoutException):
        return WorkerFailure(504, "worker_timeout", f"{worker} sent nothing for {read_timeout:g} s "
                             "(--read-timeout)", "timeout")
    return WorkerFailure(502, "worker_failed", f"{worker} broke off its answer: {detail}", "broken")


def prefill_body(body: dict, chat: bool, decode_engine_id: str) -> dict:
    """The prefill worker's request (the contract's step 2): one token, not streamed, one choice,
    the KV kept for the decode worker of that engine id. min_tokens and stream_options would
    contradict that."""
    b = {k: v for k, v in body.items() if k not in ("min_tokens", "stream_options")}
    b.update(max_tokens=1, stream=False, n=1,
             kv_transfer_params={"do_remote_decode": True, "decode_engine_id": decode_engine_id})
    if chat and "max_completion_tokens" in body:
        b["max_completion_tokens"] = 1
    return b


def kv_params(content: bytes, worker) -> dict:
    """The kv_transfer_params of a prefill worker's answer (the contract's step 3)."""
    try:
        params = json.loads(content).get("kv_transfer_params")
    except (ValueError, AttributeError):
        params = None
    if not isinstance(params, dict):
        raise WorkerFailure(502, "bad_worker_response", f"{worker} answered without kv_transfer_params "
                            "(is it a `--role prefill` worker?)", "broken")
    return params


async def prefill_then_decode(path: str, body: dict, prefill, decode, decode_engine_id: str, secret: str | None):
    """One request's two calls, however the workers are reached (this proxy over HTTP, the Ray
    ingress over Serve handles). `prefill(body)` returns (a prefill worker's 200 answer, the
    worker) or raises Refused / WorkerFailure; `decode(body)`, a call to the decode worker of
    decode_engine_id, returns the client's response. If it does not (refused, failed, or
    cancelled: the client left), the lease is released here (with the secret)."""
    content, worker = await prefill(prefill_body(body, path.endswith("/chat/completions"), decode_engine_id))
    params = kv_params(content, worker)
    try:
        return await decode({**body, "kv_transfer_params": params})
    except BaseException:
        release_lease(params, secret)
        raise


def release_lease(params: dict, secret: str | None) -> None:
    """End the lease of a prefill worker's params now, in the background, as the decode worker
    it was made for (a lease already taken and released: nothing happens)."""
    if secret is None or not auth.signed(secret, params):   # nothing to prove ourselves with, or not a lease
        return
    peer = tcp.Peer(params["remote_host"], params["remote_port"], secret, params["decode_engine_id"])
    asyncio.get_running_loop().run_in_executor(None, tcp.release, peer, params["remote_request_id"])


def _is_token_event(event: bytes) -> bool:
    """An event with a choice that is more than chat's opening role delta."""
    try:
        data = json.loads(event[len(b"data: "):])
    except ValueError:
        return False
    choices = data.get("choices") if isinstance(data, dict) else None
    return bool(choices) and any("role" not in (c.get("delta") or {}) for c in choices if isinstance(c, dict))


class Proxy:
    def __init__(self, prefill: Pool, decode: Pool, metrics: ProxyMetrics, read_timeout: float,
                 api_key: str | None = None, kv_secret: str | None = None, hasher=None):
        self.prefill, self.decode, self.metrics = prefill, decode, metrics
        self.hasher = hasher   # a routing.PromptHasher: the prefill worker is chosen by the prompt's prefix
        self.read_timeout, self.api_key = read_timeout, api_key
        self.kv_secret = kv_secret   # to release the leases of decode calls that did not go through
        if kv_secret is None:
            log.warning("no --kv-transfer-secret: the lease of a decode call that is refused or whose client "
                        "leaves is freed only when the prefill worker's --kv-lease-s runs out")
        self.client: httpx.AsyncClient | None = None   # made on the serving event loop (app lifespan)

    def headers_for(self, client_headers) -> dict:
        """What the workers get: JSON, and the key (the proxy's own, else the client's)."""
        h = {"content-type": "application/json"}
        if self.api_key:
            h["authorization"] = f"Bearer {self.api_key}"
        elif "authorization" in client_headers:
            h["authorization"] = client_headers["authorization"]
        if "x-request-id" in client_headers:
            h["x-request-id"] = client_headers["x-request-id"]
        return h

    async def _post(self, worker: Worker, path: str, body: dict, headers: dict) -> httpx.Response:
        try:
            return await self.client.post(worker.url + path, content=json.dumps(body), headers=headers)
        except httpx.HTTPError as e:
            raise failure(worker, e, self.read_timeout) from None

    def _prefill(self, path: str, headers: dict, hashes: list[int]):
        """The prefill call for prefill_then_decode: the prompt's KV, held by a prefill worker
        (the one that holds most of its prefix, with prefix-aware routing)."""
        async def call(body: dict) -> tuple[bytes, Worker]:
            worker = self.prefill.choose(hashes)
            t0 = time.perf_counter()
            with self.prefill.busy(worker):
                r = await self._post(worker, path, body, headers)
            if r.status_code != 200:
                raise Refused.of(r)
            self.metrics.prefill.observe(time.perf_counter() - t0)
            return r.content, worker
        return call

    async def _two_calls(self, path: str, body: dict, headers: dict, decode) -> Response:
        """prefill_then_decode with the decode worker chosen first: decode(worker, body)."""
        # the prompt is rendered off the event loop (a long chat template takes a while)
        hashes = [] if self.hasher is None else await asyncio.to_thread(self.hasher, path, body)
        worker = self.decode.choose()
        return await prefill_then_decode(path, body, self._prefill(path, headers, hashes),
                                         lambda b: decode(worker, b), worker.engine_id, self.kv_secret)

    async def complete(self, path: str, body: dict, headers: dict, arrival: float) -> Response:
        async def decode(worker: Worker, body: dict) -> Response:
            with self.decode.busy(worker):
                r = await self._post(worker, path, body, headers)
            if r.status_code != 200:
                raise Refused.of(r)
            return Response(r.content, status_code=200, media_type=r.headers.get("content-type", "application/json"))
        return await self._two_calls(path, body, headers, decode)

    async def stream(self, path: str, body: dict, headers: dict, arrival: float, endpoint: str) -> Response:
        async def decode(worker: Worker, body: dict) -> Response:
            self.decode.router.sent(worker)
            t0 = time.perf_counter()
            try:
                request = self.client.build_request("POST", worker.url + path, headers=headers,
                                                    content=json.dumps(body))
                upstream = await self.client.send(request, stream=True)
            except BaseException as e:
                self.decode.router.completed(worker)
                if isinstance(e, httpx.HTTPError):
                    raise failure(worker, e, self.read_timeout) from None
                raise
            if upstream.status_code != 200:
                try:
                    await upstream.aread()
                except httpx.HTTPError as e:
                    raise failure(worker, e, self.read_timeout) from None
                finally:
                    await upstream.aclose()
                    self.decode.router.completed(worker)
                raise Refused.of(upstream)
            return RelayedStream(self, worker, upstream, endpoint, arrival, t0)
        return await self._two_calls(path, body, headers, decode)

    async def answer(self, endpoint: str, work, arrival: float) -> Response:
        """The response of `work` (complete or stream), with refusals and failures turned into
        responses, and the outcome counted (a relayed stream counts its own when it ends)."""
        outcome = "cancelled"   # unless `work` ends
        try:
            response = await work
            outcome = None if isinstance(response, RelayedStream) else "success"
            return response
        except Refused as r:
            outcome = "client_error" if r.status < 500 else "worker_error"
            return r.response()
        except WorkerFailure as f:
            log.warning("%s: %s", endpoint, f.message)
            outcome = f.outcome
            return f.response()
        finally:
            if outcome is not None:
                self.metrics.outcome(endpoint, outcome)
                self.metrics.e2e.observe(time.perf_counter() - arrival)


class RelayedStream(StreamingResponse):
    """The decode worker's event stream, relayed one whole event at a time (so an error event can
    always follow what was sent). Closing it, however it ends, closes the upstream response, which
    aborts the request on the worker if it was still running."""

    def __init__(self, proxy: Proxy, worker: Worker, upstream: httpx.Response, endpoint: str, arrival: float,
                 sent: float):
        super().__init__(self._events(), media_type="text/event-stream", headers=SSE_HEADERS)
        self.proxy, self.worker, self.upstream, self.endpoint = proxy, worker, upstream, endpoint
        self.arrival, self.sent = arrival, sent
        self.outcome: str | None = None   # set when the relay ends by itself; None: the client left
        self._closed = False

    async def _events(self):
        buffer, done, first, worker_error = b"", False, False, False
        try:
            async for chunk in self.upstream.aiter_raw():
                buffer += chunk
                while (end := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[:end + 2], buffer[end + 2:]
                    if event.startswith(b"data: [DONE]"):
                        done = True
                    elif event.startswith(b'data: {"error"'):
                        worker_error = True
                    elif not first and _is_token_event(event):
                        first = True
                        now = time.perf_counter()
                        self.proxy.metrics.decode_ttft.observe(now - self.sent)
                        self.proxy.metrics.ttft.observe(now - self.arrival)
                    yield event
            if not done:
                raise WorkerFailure(502, "worker_failed", f"{self.worker} ended its stream before [DONE]", "broken")
            self.outcome = "worker_error" if worker_error else "success"
        except (httpx.HTTPError, WorkerFailure) as e:
            f = e if isinstance(e, WorkerFailure) else failure(self.worker, e, self.proxy.read_timeout)
            log.warning("%s: %s", self.endpoint, f.message)
            self.outcome = f.outcome
            yield f.event()
            yield DONE.encode()

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        """Once, however the stream ended: the upstream closed, the worker's count and the outcome."""
        if self._closed:
            return
        self._closed = True
        self.proxy.decode.router.completed(self.worker)
        try:
            await self.upstream.aclose()
        finally:
            self.proxy.metrics.outcome(self.endpoint, self.outcome or "cancelled")
            self.proxy.metrics.e2e.observe(time.perf_counter() - self.arrival)
