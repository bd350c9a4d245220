"""One engine replica: pdserve's own server (the FastAPI app of pdserve/server, its admission,
AsyncEngine and OpenAI endpoints) inside a Ray Serve replica, called over ASGI instead of a socket.

The ingress forwards each HTTP request as (method, path, headers, body); forward() runs it through
the app and streams back the response: first {"status", "headers"}, then the body's chunks as they
are sent (an SSE stream token by token). When the caller goes away (its client disconnected), Serve
cancels the generator: the app then sees http.disconnect and aborts the request, as it would for a
client of `pdserve serve`.

In P/D pools (entrypoints/ray_serve.py) a replica is a `--role prefill` or `--role decode` engine; with
node_kv_host, a prefill replica's KV listener binds its node's IP (the address Ray reaches that
node by), so that a decode replica on another node can pull the KV from it over TCP."""
import asyncio
import os

import ray
from ray import serve

from pdserve.server.config import ServerConfig


class EngineReplica:
    def __init__(self, engine_kwargs: dict, config: ServerConfig, node_kv_host: bool = False):
        from pdserve.engine.llm_engine import LLMEngine   # torch: only in the replica's process
        from pdserve.server.app import build_app
        from pdserve.server.async_engine import EngineThread

        if node_kv_host:
            engine_kwargs = {**engine_kwargs, "kv_transfer_host": ray.util.get_node_ip_address()}
        thread = EngineThread()   # builds the engine and steps it (async_engine.EngineThread says why)
        self.engine = thread.call(LLMEngine, **engine_kwargs)
        self.app = build_app(self.engine, config, thread)
        self.state = self.app.state.pdserve
        self._started = False
        self.in_flight = 0   # forward() calls under way
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()

    def _start(self) -> None:
        if not self._started:   # on the replica's event loop, which the engine's outputs are posted to
            self.state.async_engine.start()
            self._started = True

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes, block_hashes: list[int] | None = None):
        """The app's response to one HTTP request: a dict (status, headers), then body chunks.
        block_hashes is for the request router (request_router.py), not used here."""
        self._start()
        self.in_flight += 1
        sent: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if pending:
                return pending.pop()
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await sent.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
                 "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            while True:
                getter = asyncio.ensure_future(sent.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():   # the app returned without sending the rest
                    getter.cancel()
                    task.result()
                    return
                message = getter.result()
                if message["type"] == "http.response.start":
                    extra = [(b"x-pdserve-replica", self.name.encode()), (b"x-pdserve-node", self.node_id.encode())]
                    yield {"status": message["status"], "headers": list(message.get("headers", [])) + extra}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        return
        finally:
            self.in_flight -= 1
            disconnected.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, 5.0)   # its finally blocks abort the engine requests
                except (asyncio.TimeoutError, Exception):
                    task.cancel()

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop died is replaced."""
        if self._started and not self.state.async_engine.alive:
            raise RuntimeError(f"the engine is not running: {self.state.async_engine.error!r}")

    def record_routing_stats(self) -> dict:
        """What the request router reads (request_router.py): the KV cache this replica has."""
        return {"kv_blocks": self.engine.num_kv_blocks}

    def info(self) -> dict:
        """Who this replica is, its KV cache, its requests in flight, its KV transfer role and
        (a prefill replica) the leases it holds."""
        return {"replica": self.name, "node_id": self.node_id, "pid": os.getpid(), "requests": self.in_flight,
                "kv_blocks": self.engine.num_kv_blocks, "kv_transfer": self.engine.kv_transfer_info(),
                "kv_leases": self.engine.num_kv_leases}
