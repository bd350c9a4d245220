"""Admission: what every handler needs (the engine, its tokenizer, the server's limits) and the checks
that turn a request body into engine requests (prompt ids plus SamplingParams)."""
import time
import uuid
from dataclasses import dataclass

from fastapi import Request

from pdserve.errors import RequestError
from pdserve.sampling_params import SamplingParams
from pdserve.server.async_engine import AsyncEngine, EngineThread, Submission
from pdserve.server.errors import APIError
from pdserve.server.metrics import ServerMetrics
from pdserve.server.step_events import StepEvents


@dataclass
class ServerConfig:
    served_model_name: str
    max_waiting: int = 256
    max_body_bytes: int = 1 << 20
    max_stop_strings: int = 16
    max_stop_length: int = 256           # characters per stop string
    max_prompt_tokens: int | None = None  # None: the engine's own check against max_model_len
    max_tokens_cap: int | None = None     # None: whatever fits in the context
    max_n: int = 64
    max_logprobs: int = 20
    request_timeout: float | None = None  # seconds from arrival; None: no limit
    api_key: str | None = None
    step_log: str | None = None   # JSONL file: one line per engine step (for `pdserve report`)


class ServerState:
    def __init__(self, engine, config: ServerConfig, engine_thread: EngineThread | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = config
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(config.step_log)
        self.step_events = StepEvents()
        self.async_engine = AsyncEngine(engine, config.max_waiting, self.metrics, config.request_timeout,
                                        engine_thread, self.step_events)
        self.created = int(time.time())

    # ---- checks

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.config.served_model_name}`", param="model", code="model_not_found")

    def check_stop(self, stop: list[str]) -> None:
        if len(stop) > self.config.max_stop_strings:
            raise RequestError(f"at most {self.config.max_stop_strings} stop strings are allowed, got {len(stop)}",
                               param="stop")
        # a long stop string is held back from streams and searched for after every token
        longest = max((len(s) for s in stop), default=0)
        if longest > self.config.max_stop_length:
            raise RequestError(f"stop strings may be at most {self.config.max_stop_length} characters long "
                               f"(--max-stop-length), got one of {longest}", param="stop")

    def check_n(self, n: int) -> None:
        if n > self.config.max_n:
            raise RequestError(f"n must be at most {self.config.max_n} (--max-n), got {n}", param="n")

    def check_logprobs(self, k: int | None, param: str) -> None:
        if k is not None and k > self.config.max_logprobs:
            raise RequestError(f"{param} must be at most {self.config.max_logprobs} (--max-logprobs), got {k}",
                               param=param)

    def check_max_tokens(self, max_tokens: int) -> None:
        cap = self.config.max_tokens_cap
        if cap is not None and max_tokens > cap:
            raise RequestError(f"max_tokens must be at most {cap} (--max-tokens-cap), got {max_tokens}",
                               param="max_tokens")

    def default_max_tokens(self, wanted: int) -> int:
        """A default max_tokens (not the client's), lowered to --max-tokens-cap."""
        cap = self.config.max_tokens_cap
        return wanted if cap is None else min(wanted, cap)

    def check_prompt_len(self, prompts: list[list[int]], param: str = "prompt") -> None:
        cap = self.config.max_prompt_tokens
        longest = max(len(p) for p in prompts)
        if cap is not None and longest > cap:
            raise RequestError(f"{param} has {longest} tokens; this server accepts at most {cap} prompt tokens "
                               "(--max-prompt-tokens)", param=param)

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        if not text:
            raise RequestError(f"{param} must not be empty", param=param)
        return self.tokenizer.encode(text)

    def prompt_ids(self, prompt) -> list[list[int]]:
        """Completions' prompt (string, strings, ids or lists of ids; shape checked by pydantic) as id lists."""
        if isinstance(prompt, str):
            return [self.encode(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [self.encode(p) for p in prompt]
        if all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        for p in prompt:
            if not p:
                raise RequestError("prompt must not be empty", param="prompt")
        return prompt   # the engine checks the ids against the model's vocabulary

    def sampling_params(self, n: int, seed: int | None, **kwargs) -> list[SamplingParams]:
        """One SamplingParams per choice. A seeded request's choice i gets seed + i: the choices
        differ, and the same request gives the same choices again."""
        return [SamplingParams(seed=None if seed is None else seed + i, **kwargs) for i in range(n)]

    # ---- submitting

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams],
                     arrival_time: float, prefix: str) -> tuple[str, Submission]:
        """Engine request `{id}-{i}` for the i-th (prompt, params) pair: choice i of the response."""
        if len(prompts) > self.config.max_waiting:   # would be refused however empty the queue
            raise RequestError(f"this request needs {len(prompts)} sequences (prompts x n) but at most "
                               f"{self.config.max_waiting} can wait (--max-waiting)", param="n")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        return request_id, await self.async_engine.submit(prompts, params, ids, arrival_time)


def get_state(request: Request) -> ServerState:
    return request.app.state.pdserve
