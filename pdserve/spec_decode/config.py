"""The speculative-decoding options, as vLLM names them (--speculative-config JSON keys)."""
import json
from dataclasses import dataclass

from pdserve.errors import ConfigError

METHODS = ("ngram", "draft_model")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
MAX_SPECULATIVE_TOKENS = 16   # a verification is one chunk; more drafts than this are rarely all accepted


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str                   # "ngram" | "draft_model"
    num_speculative_tokens: int   # k: drafts proposed per sequence and step, at most
    prompt_lookup_min: int = 2    # ngram: the shortest tail that may match
    prompt_lookup_max: int = 4    # ngram: the longest tail tried first
    model: str | None = None      # draft_model: its checkpoint directory

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not isinstance(lo, int) or not isinstance(hi, int) or not 1 <= lo <= hi:
            raise ConfigError(f"prompt_lookup_min and prompt_lookup_max must be integers with "
                              f"1 <= min <= max, got {lo!r} and {hi!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("a draft model (speculative model) is given exactly when method is draft_model")


def speculative_config(num_speculative_tokens: int, model: str | None, config_json: str | None
                       ) -> SpeculativeConfig | None:
    """The speculation the engine flags ask for (None: off). The JSON's keys override the flags."""
    opts: dict = {}
    if config_json:
        try:
            opts = json.loads(config_json)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(opts, dict):
            raise ConfigError("speculative_config must be a JSON object")
        unknown = sorted(set(opts) - set(KEYS))
        if unknown:
            raise ConfigError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    model = opts.get("model", model)
    k = opts.get("num_speculative_tokens", num_speculative_tokens)
    if not k and not opts:
        if model is not None:
            raise ConfigError("--speculative-model needs --num-speculative-tokens (k >= 1)")
        return None
    method = opts.get("method", "draft_model" if model is not None else "ngram")
    extra = {key: opts[key] for key in ("prompt_lookup_min", "prompt_lookup_max") if key in opts}
    if "prompt_lookup_max" in extra and "prompt_lookup_min" not in extra:   # vLLM: one given sets both
        extra["prompt_lookup_min"] = min(SpeculativeConfig.prompt_lookup_min, extra["prompt_lookup_max"])
    elif "prompt_lookup_min" in extra and "prompt_lookup_max" not in extra:
        extra["prompt_lookup_max"] = max(SpeculativeConfig.prompt_lookup_max, extra["prompt_lookup_min"])
    return SpeculativeConfig(method, k, model=model, **extra)
