"""Admission: what every handler needs (the engine, its tokenizer, the server's limits) and the checks
that turn a request body into engine requests (prompt ids plus SamplingParams)."""
import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from pdserve import __version__
from pdserve.engine.interface import EngineClient, paged
from pdserve.errors import RequestError
from pdserve.generation_config import GenerationDefaults
from pdserve.sampling_params import SamplingParams
from pdserve.server import reasoning
from pdserve.server.async_engine import AsyncEngine, EngineThread, Submission
from pdserve.server.config import ServerConfig
from pdserve.server.errors import APIError, Overloaded
from pdserve.server.metrics import ServerMetrics
from pdserve.server.step_events import StepEvents


# Texts longer than this are tokenized on a worker thread, so the event loop keeps answering.
OFFLOAD_CHARS = 4096


class ServerState:
    def __init__(self, engine: EngineClient, config: ServerConfig, engine_thread: EngineThread | None = None):
        self.engine = engine
        self.paged = paged(engine)   # None: a baseline, without a paged KV cache
        self.tokenizer = engine.tokenizer
        self.config = config
        self.max_model_len = engine.max_model_len
        # the longest sequence that can be served: the context, or the whole KV cache if smaller
        self.max_seq_len = self.max_model_len if self.paged is None else min(self.max_model_len,
                                                                             self.paged.kv_capacity)
        self.metrics = ServerMetrics(config.step_log, config.served_model_name)
        self.step_events = StepEvents()
        self.async_engine = AsyncEngine(engine, config.max_waiting, self.metrics, config.request_timeout,
                                        engine_thread, self.step_events)
        self.created = int(time.time())
        # --reasoning-parser, checked against this tokenizer (ConfigError: its tags are not tokens)
        self.reasoning = reasoning.build(config.reasoning_parser, self.tokenizer)
        # generation_config.json's sampling defaults (--generation-config); a test's stand-in engine has none
        engine_config = getattr(engine, "config", None)
        self.generation = engine_config.generation_defaults() if hasattr(engine_config, "generation_defaults") \
            else GenerationDefaults()
        self.version = __version__
        # A prompt longer than this many characters has more tokens than the cap (Tokenizer.max_token_chars):
        # refused before any tokenizing.
        self.max_prompt_chars = (config.max_prompt_tokens or self.max_model_len) * \
            getattr(self.tokenizer, "max_token_chars", 1 << 20)
        # Tokenizing long texts and building big responses: off the event loop, two at a time.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-cpu")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def offload(self, fn, *args):
        """fn(*args) on a worker thread (CPU-heavy Python: the loop keeps answering while it runs)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- checks

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.config.served_model_name}`", param="model", code="model_not_found")

    def check_stop(self, stop: list[str], stop_token_ids: list[int] | None = None) -> None:
        if stop_token_ids and len(stop_token_ids) > self.config.max_stop_token_ids:
            raise RequestError(f"at most {self.config.max_stop_token_ids} stop_token_ids are allowed "
                               f"(--max-stop-token-ids), got {len(stop_token_ids)}", param="stop_token_ids")
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
        if k is not None and k < 0:
            raise RequestError(f"{param} must be >= 0, got {k}", param=param)
        if k is not None and k > self.config.max_logprobs:
            raise RequestError(f"{param} must be at most {self.config.max_logprobs} (--max-logprobs), got {k}",
                               param=param)

    def check_queue(self, num_seqs: int, param: str = "n") -> None:
        """Before any tokenizing: 400 if `num_seqs` could never be admitted, 503 if not now."""
        most = self.config.max_waiting + self.async_engine.max_num_seqs
        if num_seqs > most:   # would be refused however empty the queue
            raise RequestError(f"this request needs {num_seqs} sequences (prompts x n) but at most {most} can be "
                               f"admitted at once (--max-waiting + --max-num-seqs)", param=param)
        if not self.async_engine.has_room(num_seqs):
            raise Overloaded(f"too many requests waiting (--max-waiting {self.config.max_waiting}); retry later")

    def check_cost(self, num_seqs: int, max_tokens: int, logprobs: int | None) -> None:
        """What one request may make the server generate and send: every choice's tokens, each
        with its logprobs (--max-request-cost)."""
        cost = num_seqs * max_tokens * (1 + (logprobs or 0))
        if cost > self.config.max_request_cost:
            raise RequestError(f"this request asks for {num_seqs} sequences (prompts x n) x max_tokens {max_tokens} "
                               f"x (1 + logprobs {logprobs or 0}) = {cost} tokens, more than --max-request-cost "
                               f"({self.config.max_request_cost}); lower max_tokens, n or logprobs",
                               param="max_tokens")

    def check_prompt_logprobs(self, k: int | None, param: str) -> None:
        """prompt_logprobs (or echo with logprobs, which asks for them): within --max-logprobs, and
        from an engine that computes them (the baselines and test fakes do not)."""
        if k is None:
            return
        self.check_logprobs(k, param)
        if self.paged is None or not self.paged.computes_prompt_logprobs:
            raise RequestError(f"prompt logprobs are not computed by the {getattr(self.engine, 'name', '') or 'this'} "
                               "backend", param=param)

    def check_prompt_cost(self, num_seqs: int, max_tokens: int, logprobs: int | None, prompts: list[list[int]],
                          n: int, k: int | None, param: str) -> None:
        """--max-request-cost with prompt logprobs: each choice's prompt tokens count as tokens sent
        with their k alternatives, on top of its generated ones (same rule, same limit)."""
        if k is None:
            return
        out = num_seqs * max_tokens * (1 + (logprobs or 0))
        prompt = self.prompt_cost(prompts, n, k)
        if out + prompt > self.config.max_request_cost:
            raise RequestError(f"this request asks for {out} generated tokens with their logprobs + {n} x "
                               f"{sum(len(p) for p in prompts)} prompt tokens x (1 + prompt logprobs {k}) = "
                               f"{out + prompt} tokens, more than --max-request-cost ({self.config.max_request_cost}); "
                               "lower the prompt's length, n or the logprobs asked for", param=param)

    def cost_default(self, wanted: int, num_seqs: int, logprobs: int | None, spent: int = 0) -> int:
        """A default max_tokens lowered so the request fits --max-request-cost (at least 1);
        `spent`: what its prompt logprobs already take of it (prompt_cost)."""
        return max(1, min(wanted, (self.config.max_request_cost - spent) // (num_seqs * (1 + (logprobs or 0)))))

    @staticmethod
    def prompt_cost(prompts: list[list[int]], n: int, k: int | None) -> int:
        """The prompt logprobs' share of --max-request-cost: each choice's prompt tokens, each with k alternatives."""
        return 0 if k is None else n * sum(len(p) for p in prompts) * (1 + k)

    def check_prompt_chars(self, texts: list[str], param: str = "prompt") -> None:
        """Refuse, before tokenizing, a text so long it must have more tokens than the cap."""
        longest = max((len(t) for t in texts), default=0)
        if longest > self.max_prompt_chars:
            cap = self.config.max_prompt_tokens or self.max_model_len
            flag = "--max-prompt-tokens" if self.config.max_prompt_tokens else "the context length"
            raise RequestError(f"{param} has {longest} characters: more tokens than this server accepts ({cap}, "
                               f"{flag}) whatever the text", param=param)

    def check_max_tokens(self, max_tokens: int) -> None:
        cap = self.config.max_tokens_cap
        if cap is not None and max_tokens > cap:
            raise RequestError(f"max_tokens must be at most {cap} (--max-tokens-cap), got {max_tokens}",
                               param="max_tokens")

    def default_max_tokens(self, wanted: int) -> int:
        """A default max_tokens (not the client's), lowered to --max-tokens-cap."""
        cap = self.config.max_tokens_cap
        return wanted if cap is None else min(wanted, cap)

    def request_max_tokens(self, asked: int | None, default: int, num_seqs: int, logprobs: int | None,
                           room: int | None = None, generation: bool = True, spent: int = 0) -> int:
        """A request's max_tokens, decided here for every endpoint: the client's (checked against
        --max-tokens-cap); else generation_config.json's max_new_tokens (unless generation=False), else
        the endpoint's `default`. A default is lowered to `room` (the context left, as vLLM's
        get_max_tokens), --max-tokens-cap and --max-request-cost (of which prompt logprobs take
        `spent`), and is at least 1."""
        if asked is not None:
            self.check_max_tokens(asked)
            return asked
        wanted = (self.generation.max_tokens if generation else None) or default
        if room is not None:
            wanted = min(wanted, room)
        return self.cost_default(max(1, self.default_max_tokens(wanted)), num_seqs, logprobs, spent)

    def check_prompt_len(self, prompts: list[list[int]], param: str = "prompt") -> None:
        cap = self.config.max_prompt_tokens
        longest = max(len(p) for p in prompts)
        if cap is not None and longest > cap:
            raise RequestError(f"{param} has {longest} tokens; this server accepts at most {cap} prompt tokens "
                               "(--max-prompt-tokens)", param=param)

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
