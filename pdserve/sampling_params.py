"""Per-request sampling parameters, validated before a request is admitted."""
import math
from dataclasses import dataclass, field

from pdserve.engine.grammar import GrammarSpec
from pdserve.errors import RequestError
from pdserve.objectives import RequestObjectives


# Bounds a tensor can hold whatever the model; admission checks against the vocabulary itself.
MAX_TOP_K = MAX_TOKEN_ID = 2**31 - 1
# Alternatives per token that logprobs and prompt_logprobs may ask for (vLLM's max_logprobs default);
# the server's --max-logprobs lowers it per request.
MAX_LOGPROBS = 20


@dataclass(slots=True)   # read per sequence in every step: slots, not a dict
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # nucleus mass kept, in (0, 1]
    top_k: int = 0                    # 0 (or -1) = off
    min_p: float = 0.0                # drop tokens below min_p * p(top token)
    seed: int | None = None           # same seed, same output, whatever else is in the batch
    presence_penalty: float = 0.0     # OpenAI: subtract once if the token appeared in the output
    frequency_penalty: float = 0.0    # OpenAI: subtract per occurrence in the output
    repetition_penalty: float = 1.0   # CTRL/HF: divide positive (multiply negative) logits of seen tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0               # EOS and stop tokens are masked until this many tokens exist
    logprobs: int | None = None       # top-N logprobs per generated token (plus the sampled one)
    # top-N logprobs per prompt token (plus the prompt's own), the first token's None (vLLM's
    # prompt_logprobs): what scoring and perplexity read. The prefix cache is not used for the
    # prompt of such a request (its cached positions have no logits): it is computed again.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None   # constrained decoding (pdserve/engine/grammar.py)
    # A token id: the grammar constrains only what follows the first time this token is generated
    # (a reasoning parser's end-of-thinking token: the thinking is free, the answer constrained,
    # as vLLM's structured outputs wait for the reasoning to end). None: from the first token.
    grammar_after_token: int | None = None
    # Only the finished output, none per step (vLLM's RequestOutputKind.FINAL_ONLY): what
    # LLM.generate and non-streamed API responses read. Saves making an output per request and step.
    final_only: bool = False
    # Prefix-cache isolation (vLLM's cache_salt): requests share cached blocks only with requests of
    # the same salt, so one tenant cannot learn from timing what another's prompts were.
    cache_salt: str | None = None
    # priority and TTFT/TPOT targets, read by the scheduling policy (pdserve/engine/policy.py)
    objectives: RequestObjectives | None = None
    # prefill/decode disaggregation (vLLM carries it in extra_args): pdserve.kv_transfer.KVTransferParams
    kv_transfer_params: object | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self):
        def bad(param, why):
            raise RequestError(f"{param} {why}", param=param)

        # Every float the sampler turns into a tensor must be a finite number: inf (JSON Infinity,
        # 1e999) passes a range check like ">= 0" and then makes every probability NaN.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            # the vocabulary bounds it further, at admission (OutputProcessor.new_sequence)
            bad("top_k", f"must be -1, 0 (off) or a positive integer up to the vocabulary size, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if self.objectives is not None and not isinstance(self.objectives, RequestObjectives):
            bad("objectives", f"must be a RequestObjectives, got {type(self.objectives).__name__}")
        if not isinstance(self.final_only, bool):
            bad("final_only", f"must be true or false, got {self.final_only!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            bad("cache_salt", f"must be a non-empty string, got {self.cache_salt!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            # torch's generator takes no more; a larger seed would fail the whole engine step
            bad("seed", f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            bad("grammar", f"must be a GrammarSpec, got {type(self.grammar).__name__}")
        if self.grammar_after_token is not None and (not isinstance(self.grammar_after_token, int)
                                                     or not 0 <= self.grammar_after_token <= MAX_TOKEN_ID):
            bad("grammar_after_token", f"must be a token id, got {self.grammar_after_token!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers (token ids)")

    @property
    def greedy(self) -> bool:
        # as vLLM: so small a temperature is greedy in effect, and far smaller ones overflow
        # logits / temperature to inf, which would make the draw NaN
        return self.temperature < 1e-5
