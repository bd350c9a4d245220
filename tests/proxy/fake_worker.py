"""Workers of the prefill/decode contract (docs/API.md, "Disaggregated serving") as small FastAPI
apps in the test process: a prefill worker answers one token and a kv_transfer_params object,
holding a lease; a decode worker takes only params a prefill worker issued, "generates" one word
per token (w0 w1 ...), and releases the lease when it finishes or its client leaves. Each records
the bodies it got, and the path of every request. `behaviour` makes one misbehave: refuse, hang, or
die in the middle; `models` makes its model list normal ("ok"), never end ("trickle": a byte at a
time; "flood": as fast as it can) or never start ("hang"), and its /health too (but "flood").

It also has routes the proxy must never reach: /v1/engine/steps and /metrics, as a real worker."""
import asyncio
import itertools
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.server.streaming import unless_disconnected

LEASES: dict[str, str] = {}   # remote_request_id -> the prefill worker's engine id, while held
_ids = itertools.count()


class PathRecorder:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware would change how a dying stream ends)."""

    def __init__(self, app, paths: list[str]):
        self.app, self.paths = app, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


class FakeWorker:
    def __init__(self, role: str, model: str = "tiny", block_size: int = 16, dtype: str = "float32",
                 behaviour: str = "ok", token_delay: float = 0.0, refusal: tuple = (400, "temperature"),
                 models: str = "ok"):
        self.role, self.model, self.block_size, self.dtype = role, model, block_size, dtype
        self.behaviour, self.token_delay, self.refusal, self.models = behaviour, token_delay, refusal, models
        self.paths: list[str] = []   # of every request, as the worker's router saw it
        self.listing = 0    # model lists being sent now
        self.engine_id = f"{role}-{next(_ids)}"
        self.bodies: list[dict] = []
        self.aborted = 0    # decode requests whose client left before the end
        self.running = 0
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()
        app.add_middleware(PathRecorder, paths=self.paths)

        @app.get("/v1/kv_transfer")
        async def kv_transfer():
            return {"role": self.role, "engine_id": self.engine_id, "block_size": self.block_size,
                    "dtype": self.dtype, "transport": "tcp", "kv_host": "127.0.0.1", "kv_port": 1, "model": self.model}

        @app.get("/health")
        async def health():
            if self.models == "hang":
                await asyncio.sleep(3600)
            if self.models == "trickle":
                return StreamingResponse(self._endless(1), media_type="application/json")
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            if self.models == "hang":
                await asyncio.sleep(3600)
            if self.models in ("trickle", "flood"):
                return StreamingResponse(self._endless(1 if self.models == "trickle" else 1 << 16),
                                         media_type="application/json")
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "pdserve"}]}

        @app.get("/v1/engine/steps")
        async def steps():
            return StreamingResponse(self._endless(64), media_type="application/x-ndjson")

        @app.get("/metrics")
        async def metrics():
            return Response("pdserve:secret 1\n", media_type="text/plain")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._generate(request, await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._generate(request, await request.json(), chat=True)
        return app

    async def _generate(self, request: Request, body: dict, chat: bool):
        self.bodies.append(body)
        if self.behaviour == "refuse":
            status, param = self.refusal
            return JSONResponse({"error": {"message": f"{param}: refused by the fake", "type":
                                           "invalid_request_error" if status < 500 else "server_error",
                                           "param": param, "code": None}},
                                status_code=status, headers={"Retry-After": "1"} if status == 503 else None)
        if self.behaviour == "hang":
            await asyncio.sleep(3600)
        if self.role == "prefill":
            rid = uuid.uuid4().hex
            LEASES[rid] = self.engine_id
            params = {"do_remote_prefill": True, "remote_engine_id": self.engine_id, "remote_host": "127.0.0.1",
                      "remote_port": 1, "remote_request_id": rid, "num_tokens": 4, "transport": "tcp",
                      "block_size": self.block_size, "dtype": self.dtype}
            return JSONResponse({**answer(body, chat, 1), "kv_transfer_params": params})
        params = body.get("kv_transfer_params") or {}
        if LEASES.get(params.get("remote_request_id")) != params.get("remote_engine_id"):
            return JSONResponse({"error": {"message": "kv_transfer_params: no such lease", "type":
                                           "invalid_request_error", "param": "kv_transfer_params", "code": None}},
                                status_code=400)
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        if not body.get("stream"):
            if self.behaviour == "die":   # a response started, then the process is gone
                return StreamingResponse(self._die_after(b'{"id": "x", "choi'), media_type="application/json")
            # as pdserve's server: a client that leaves cancels the wait (and the request)
            return await unless_disconnected(request, self._plain(body, chat, n, params))
        return StreamingResponse(self._events(body, chat, n, params), media_type="text/event-stream")

    async def _plain(self, body: dict, chat: bool, n: int, params: dict) -> JSONResponse:
        self.running += 1
        done = False
        try:
            await asyncio.sleep(self.token_delay * n)
            done = True
            return JSONResponse(answer(body, chat, n))
        finally:
            self.running -= 1
            self.aborted += not done
            LEASES.pop(params["remote_request_id"], None)

    async def _endless(self, size: int):
        self.listing += 1
        try:
            while True:
                yield b" " * size
                await asyncio.sleep(0.05 if size == 1 else 0)
        finally:
            self.listing -= 1

    async def _die_after(self, data: bytes):
        yield data
        raise RuntimeError("the fake worker died")

    async def _events(self, body: dict, chat: bool, n: int, params: dict):
        self.running += 1
        done = False
        head = {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model}
        try:
            if chat:
                yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            for i in range(n):
                if self.behaviour == "die" and i == 3:
                    raise RuntimeError("the fake worker died")
                if self.behaviour == "stall" and i == 3:
                    await asyncio.sleep(3600)
                await asyncio.sleep(self.token_delay)
                last = "length" if i == n - 1 else None
                choice = ({"index": 0, "delta": {"content": f"w{i} "}} if chat else {"index": 0, "text": f"w{i} "})
                yield sse({**head, "choices": [{**choice, "logprobs": None, "finish_reason": last}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield sse({**head, "choices": [], "usage": usage(n)})
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            self.running -= 1
            self.aborted += not done
            LEASES.pop(params["remote_request_id"], None)


def sse(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def usage(n: int) -> dict:
    return {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}


def text(n: int) -> str:
    return "".join(f"w{i} " for i in range(n))


def answer(body: dict, chat: bool, n: int) -> dict:
    head = {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion", "created": 0,
            "model": body.get("model") or "tiny", "usage": usage(n)}
    choice = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        return {**head, "choices": [{**choice, "message": {"role": "assistant", "content": text(n)}}]}
    return {**head, "choices": [{**choice, "text": text(n)}]}
