"""Admission decisions: every limit and default of a request, decided on the server before
anything reaches the engine, and the refusals they make (400 in OpenAI's format naming the
parameter; 503 with Retry-After when the queue is full; 404 for another model). Nothing here
needs an engine: Limits is built from the ServerConfig and what the engine publishes of itself
(its context, KV capacity, seats, generation defaults), and asks the queue for room through
`has_room`. ServerState (admission.py) is one, with the engine wired in."""
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import RequestError
from pdserve.generation_config import GenerationDefaults
from pdserve.server.config import ServerConfig
from pdserve.server.errors import APIError, Overloaded


def queue_full(max_waiting: int, waiting: int | None = None) -> Overloaded:
    """The 503 of a full queue (`waiting`: how many wait, where the caller counted them)."""
    counted = "" if waiting is None else f"{waiting}, "
    return Overloaded(f"too many requests waiting ({counted}--max-waiting {max_waiting}); retry later")


@dataclass(eq=False)
class Limits:
    config: ServerConfig
    max_model_len: int            # the context
    max_seq_len: int              # the longest sequence that can be served: the context, or the KV cache if smaller
    max_num_seqs: int             # the engine's seats
    has_room: Callable[[int], bool]   # whether n more sequences fit in the queue now
    generation: GenerationDefaults | None = None   # generation_config.json's (--generation-config)
    max_token_chars: int = 1 << 20          # the longest text one token can be (Tokenizer.max_token_chars)
    computes_prompt_logprobs: bool = False
    engine_name: str = ""                   # a baseline's --baseline, for the refusals that name it

    def __post_init__(self):
        if self.generation is None:
            self.generation = GenerationDefaults()
        # A prompt longer than this many characters has more tokens than the cap: refused before any tokenizing.
        self.max_prompt_chars = (self.config.max_prompt_tokens or self.max_model_len) * self.max_token_chars

    def default_within_context(self, max_tokens: int, prompt: list[int]) -> int:
        """The origin endpoints' default max_tokens stops at the context rather than being refused
        (as the OpenAI endpoints' default, the rest of the context, does)."""
        return min(max_tokens, max(1, self.max_model_len - len(prompt)))

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
        most = self.config.max_waiting + self.max_num_seqs
        if num_seqs > most:   # would be refused however empty the queue
            raise RequestError(f"this request needs {num_seqs} sequences (prompts x n) but at most {most} can be "
                               f"admitted at once (--max-waiting + --max-num-seqs)", param=param)
        if not self.has_room(num_seqs):
            raise queue_full(self.config.max_waiting)

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
        if not self.computes_prompt_logprobs:
            raise RequestError(f"prompt logprobs are not computed by the {self.engine_name or 'this'} "
                               "baseline", param=param)

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
