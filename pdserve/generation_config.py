"""A checkpoint's generation_config.json as the default sampling of every request, as vLLM's
`--generation-config auto` (ModelConfig.get_diff_sampling_param, read by its OpenAI serving code
and LLM.get_default_sampling_params):

  auto   the model directory's generation_config.json (none there: no defaults)
  vllm   ignore it: SamplingParams' own defaults
  DIR    DIR/generation_config.json, which must exist

Its temperature, top_p, top_k, min_p and repetition_penalty become the defaults of those fields,
and max_new_tokens the max_tokens of a request that gives none; anything the request sets wins.
As vLLM, do_sample is not read: a file's temperature applies whatever do_sample says."""
import os
from dataclasses import dataclass, field

from pdserve.checkpoint_files import checkpoint_file, read_json_object
from pdserve.errors import ConfigError, RequestError

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict = field(default_factory=dict)   # SamplingParams field -> value
    max_tokens: int | None = None                  # from max_new_tokens
    source: str | None = None                      # the file read, for the log

    def sampling_kwargs(self, request: dict, fallback: dict | None = None) -> dict:
        """A request's SamplingParams keyword arguments: the endpoint's own fallback, overridden by
        these defaults, overridden by what the request set (`request` holds only those)."""
        return {**(fallback or {}), **self.sampling, **request}

    def describe(self) -> str:
        """For the startup log: which defaults apply, and from where."""
        if not self.sampling and self.max_tokens is None:
            return "none (SamplingParams' own)" if self.source is None else f"none from {self.source}"
        items = [f"{k}={v}" for k, v in self.sampling.items()]
        if self.max_tokens is not None:
            items.append(f"max_tokens={self.max_tokens} (its max_new_tokens)")
        return (f"{', '.join(items)} from {self.source}; a request's own fields override them "
                "(--generation-config vllm ignores the file)")


def load_generation_defaults(source: str, model_dir: str) -> GenerationDefaults:
    """The defaults `--generation-config source` gives; a one-line ConfigError for a missing DIR, a
    broken file or a value no request could have (e.g. temperature -1)."""
    if source == "vllm":
        return GenerationDefaults()
    if source == "auto":
        if not os.path.isdir(model_dir):   # the model's own check says so, in its words
            return GenerationDefaults()
        path = checkpoint_file(model_dir, FILE)
        if not os.path.isfile(path):
            return GenerationDefaults()
    else:
        if not os.path.isdir(source):
            raise ConfigError(f"--generation-config {source}: not a directory (give auto, vllm or a directory "
                              f"holding {FILE})")
        path = os.path.join(source, FILE)
        if not os.path.isfile(path):
            raise ConfigError(f"--generation-config {source}: no {FILE} in it")
    data = read_json_object(path, ConfigError)
    sampling = {k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}
    max_tokens = data.get("max_new_tokens")
    hint = "; fix the file or start with --generation-config vllm to ignore it"
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ConfigError(f"{path}: max_new_tokens must be an integer >= 1, got {max_tokens!r}{hint}")
    from pdserve.sampling_params import SamplingParams
    try:   # the checks every request's values get
        SamplingParams(**sampling)
    except RequestError as e:
        raise ConfigError(f"{path}: {e}{hint}") from None
    return GenerationDefaults(sampling, max_tokens, path)
