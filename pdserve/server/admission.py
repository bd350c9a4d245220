"""Admission: what every handler needs (the engine, its tokenizer, the server's limits) and the
tokenizing and submitting that turn a request body into engine requests (prompt ids plus
SamplingParams); the limits themselves, every refusal and default, are limits.py's."""
import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from pdserve import __version__
from pdserve.engine.interface import EngineClient, paged
from pdserve.errors import RequestError
from pdserve.sampling_params import SamplingParams
from pdserve.server import reasoning_parsers
from pdserve.server.async_engine import AsyncEngine, EngineThread, Submission
from pdserve.server.config import ServerConfig
from pdserve.server.limits import Limits
from pdserve.server.metrics import ServerMetrics
from pdserve.server.step_events import StepEvents


# Texts longer than this are tokenized on a worker thread, so the event loop keeps answering.
OFFLOAD_CHARS = 4096


class ServerState(Limits):
    """What every handler needs: the engine and its tokenizer, the server's limits (limits.py, the
    admission decisions), and the tokenizing and submitting that turn a body into engine requests."""

    def __init__(self, engine: EngineClient, config: ServerConfig, engine_thread: EngineThread | None = None):
        self.engine = engine
        self.paged = paged(engine)   # None: a baseline, without a paged KV cache
        self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(config.step_log, config.served_model_name)
        self.step_events = StepEvents()
        self.async_engine = AsyncEngine(engine, config.max_waiting, self.metrics, config.request_timeout,
                                        engine_thread, self.step_events)
        generation = engine.config.generation_defaults()   # generation_config.json's (--generation-config)
        max_len = engine.max_model_len
        super().__init__(config, max_len, max_len if self.paged is None else min(max_len, self.paged.kv_capacity),
                         self.async_engine.max_num_seqs, self.async_engine.has_room, generation,
                         self.tokenizer.max_token_chars,
                         self.paged is not None and self.paged.computes_prompt_logprobs, engine.name)
        self.created = int(time.time())
        # --reasoning-parser, checked against this tokenizer (ConfigError: its tags are not tokens)
        self.reasoning = reasoning_parsers.build(config.reasoning_parser, self.tokenizer)
        self.version = __version__
        # Tokenizing long texts and building big responses: off the event loop, two at a time.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-cpu")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def offload(self, fn, *args):
        """fn(*args) on a worker thread (CPU-heavy Python: the loop keeps answering while it runs)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, texts: list[str], param: str = "prompt") -> list[list[int]]:
        """Token ids of each text; long ones are tokenized off the event loop."""
        if not all(texts):
            raise RequestError(f"{param} must not be empty", param=param)
        self.check_prompt_chars(texts, param)
        if sum(len(t) for t in texts) <= OFFLOAD_CHARS:
            return [self.tokenizer.encode(t) for t in texts]
        return await self.offload(lambda: [self.tokenizer.encode(t) for t in texts])

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """The chat template's tokens (kwargs, e.g. tools, go to the template); the template is
        rendered off the event loop when the text is long."""
        self.check_prompt_chars(["".join(m["content"] for m in messages)], "messages")

        def render():
            try:
                return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
            except ValueError as e:
                raise RequestError(str(e), param="messages") from None
        if sum(len(m["content"]) for m in messages) <= OFFLOAD_CHARS:
            return render()
        return await self.offload(render)

    async def prompt_ids(self, prompt) -> list[list[int]]:
        """Completions' prompt (string, strings, ids or lists of ids; shape checked by pydantic) as id lists."""
        if isinstance(prompt, str):
            return await self.encode([prompt])
        if all(isinstance(p, str) for p in prompt):
            return await self.encode(prompt)
        if all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        for p in prompt:
            if not p:
                raise RequestError("prompt must not be empty", param="prompt")
        return prompt   # the engine checks the ids against the model's vocabulary

    def sampling_params(self, n: int, seed: int | None, fallback: dict | None = None, **kwargs) -> list[SamplingParams]:
        """One SamplingParams per choice, of the fields the request set (kwargs) over the generation
        config's defaults over the endpoint's `fallback`. A seeded request's choice i gets seed + i
        (wrapping past 2**64 - 1 to 0, so every seed the client may send works with any n): the
        choices differ, and the same request gives the same choices again."""
        kwargs = self.generation.sampling_kwargs(kwargs, fallback)
        def choice_seed(i: int) -> int | None:
            if seed is None or not isinstance(seed, int) or seed >= 2**64:
                return seed   # SamplingParams refuses it, naming the value sent
            return seed + i - 2**64 if seed + i >= 2**64 else seed + i
        return [SamplingParams(seed=choice_seed(i), **kwargs) for i in range(n)]

    # ---- submitting

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams],
                     arrival_time: float, prefix: str) -> tuple[str, Submission]:
        """Engine request `{id}-{i}` for the i-th (prompt, params) pair: choice i of the response."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        return request_id, await self.async_engine.submit(prompts, params, ids, arrival_time)


def get_state(request: Request) -> ServerState:
    return request.app.state.pdserve
