"""Model and engine configuration: small dataclasses that validate themselves.

ModelConfig is read from the checkpoint's config.json (never from a table of model names); it
accepts both the transformers-4 spelling (rope_theta, rope_scaling) and the transformers-5 one
(rope_parameters)."""
import json
import logging
import os
from dataclasses import dataclass, field

import torch

from pdserve.arg_types import option
from pdserve.checkpoint_files import checkpoint_file
from pdserve.config_fields import CONFIG_FIELDS
from pdserve.errors import CheckpointError, ConfigError
from pdserve.quantization.config import HubQuantization, read_quantization
from pdserve.vlm_text import VLM_TEXT, checkpoint_tensor_names, text_raw


@dataclass
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str | None
    raw: dict = field(repr=False)  # the whole config.json, for family-specific fields
    # the longest sequence served (the engine's max_model_len; None: max_position_embeddings):
    # longrope picks its factor set by it (pdserve/layers/rotary.py)
    max_model_len: int | None = None
    # a Hub quantized checkpoint's quantization_config, as pdserve serves it (pdserve/quantization)
    quantization: "HubQuantization | None" = field(default=None, repr=False)
    gguf_file: str | None = None   # a GGUF model: the file its config, tokenizer and weights come from
    text_of: str | None = None     # a vision-language checkpoint's architecture, whose text part is served

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        """The config of an HF checkpoint directory, or of a GGUF model (a .gguf file, or a directory
        holding one and no config.json; built from its metadata: pdserve/gguf/config.py)."""
        from pdserve.gguf import gguf_file   # here: it imports errors only, but keeps gguf lazy
        gguf = gguf_file(path)
        if gguf is not None:
            return cls.from_gguf(path, gguf)
        if not os.path.isdir(path):   # never a hub name: nothing is downloaded
            raise CheckpointError(f"{path}: not a directory")
        file = checkpoint_file(path, "config.json")
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing (an HF checkpoint directory needs config.json)")
        try:
            with open(file) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: not valid JSON ({e})") from None
        text_of = next((a for a in raw.get("architectures") or [] if a in VLM_TEXT), None)
        if text_of is not None:   # serve its language model (pdserve/vlm_text.py)
            raw = text_raw(raw, file, checkpoint_tensor_names(path))
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in CONFIG_FIELDS), None)
        if raw.get("auto_map"):
            if arch is None:
                raise CheckpointError(f"{file}: declares auto_map, i.e. needs its own Python code (trust_remote_code); "
                                      "pdserve runs no code from checkpoints, only its built-in architectures")
            # Phi-3's checkpoints (and others') still carry the remote code they shipped before
            # transformers had the family: a built-in architecture runs as transformers runs it
            # without trust_remote_code, the checkpoint's code never.
            logging.getLogger("pdserve").warning("%s: declares auto_map (remote code), which pdserve never runs; "
                                                 "served as the built-in %s", file, arch)
        if arch is None:
            raise CheckpointError(f"{file}: unsupported architecture {archs or 'none given'}; "
                                  f"supported: {', '.join([*CONFIG_FIELDS, *VLM_TEXT])}")
        try:
            fields = CONFIG_FIELDS[arch](raw)
        except KeyError as e:
            raise CheckpointError(f"{file}: missing field {e.args[0]!r} for {arch}") from None
        cfg = cls(path, arch, **fields, torch_dtype=raw.get("dtype") or raw.get("torch_dtype"), raw=raw,
                  text_of=text_of)
        cfg._check(file)
        cfg.quantization = read_quantization(raw, file)   # refuses here, before a weight is read
        return cfg

    @classmethod
    def from_gguf(cls, path: str, file: str) -> "ModelConfig":
        from pdserve.gguf.config import hf_config
        from pdserve.gguf.reader import open_gguf
        raw = hf_config(open_gguf(file))
        arch = raw["architectures"][0]
        cfg = cls(path, arch, **CONFIG_FIELDS[arch](raw), torch_dtype=raw["dtype"], raw=raw,
                  gguf_file=file)
        cfg._check(file)
        return cfg

    def _check(self, file: str):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise CheckpointError(f"{file}: {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"{file}: num_attention_heads={self.num_heads} is not a multiple of "
                                  f"num_key_value_heads={self.num_kv_heads}")
        for layer_type in rope_layer_types(self.raw) or [None]:   # a bad rope fails here, before loading
            self.rope_parameters(layer_type)

    # --- RoPE ---------------------------------------------------------------------------------
    def rope_parameters(self, layer_type: str | None = None) -> dict:
        """The RoPE of the model, or of one layer type where config.json gives one per type (Gemma 3's
        full_attention / sliding_attention), normalised from either spelling: transformers-4's
        rope_theta + rope_scaling ({type|rope_type, ...}) or transformers-5's rope_parameters. Returns
        {rope_type, rope_theta, [partial_rotary_factor], the type's keys}, with the defaults transformers
        fills in (original_max_position_embeddings, yarn's and longrope's factor). Refuses in one line
        (CheckpointError) a type or a key pdserve cannot serve exactly."""
        return normalise_rope(self, layer_type)

    @property
    def rope_theta(self) -> float:
        return self.rope_parameters()["rope_theta"]

    @property
    def rope_scaling(self) -> dict | None:
        """The rope dict (rope_parameters()) that RotaryEmbedding takes, or None for plain RoPE."""
        params = self.rope_parameters()
        return None if params["rope_type"] == "default" else params

    # --- Llama-family details -------------------------------------------------------------------
    # transformers' Qwen2 and Qwen3 slide only with use_sliding_window, and (configs without
    # layer_types) only from layer max_window_layers on
    QWEN_WINDOWS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")

    @property
    def sliding_window(self) -> int | None:
        """The window of the model's sliding-window layers (None: none has one); which layers have
        it: layer_types."""
        if self.architecture in self.QWEN_WINDOWS and not self.raw.get("use_sliding_window", False):
            return None
        return self.raw.get("sliding_window")

    @property
    def layer_types(self) -> list[str]:
        """Each layer's attention ("sliding_attention" or "full_attention"), as transformers decides
        it: the config's layer_types where it has them, else Qwen's rule (layers from
        max_window_layers on slide), else every layer slides (Mistral: transformers' Mistral ignores
        layer_types). Whether any window applies is sliding_window's."""
        L = self.num_layers
        types = self.raw.get("layer_types")
        if types and self.architecture != "MistralForCausalLM":
            return list(types)
        if self.architecture in self.QWEN_WINDOWS:
            first = self.raw.get("max_window_layers", 28)
            return ["sliding_attention" if i >= first else "full_attention" for i in range(L)]
        return ["sliding_attention"] * L

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention): sliding_window on the layer_types
        that slide."""
        w, types = self.sliding_window, self.layer_types
        if w is None:
            return [None] * self.num_layers
        if len(types) != self.num_layers:
            raise CheckpointError(f"{os.path.join(self.path, 'config.json')}: layer_types has {len(types)} "
                                  f"entries for {self.num_layers} layers")
        return [w if t == "sliding_attention" else None for t in types]

    @property
    def rms_norm_eps(self) -> float:
        return float(self.raw.get("rms_norm_eps", 1e-6))


# rope type -> (required keys, optional keys) besides rope_type, rope_theta, partial_rotary_factor
ROPE_KEYS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"), ("factor", "attention_factor")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
}
ROPE_ALIASES = {"su": "longrope"}   # Phi-3's first name for it


def rope_layer_types(raw: dict) -> list[str]:
    """The layer types of a per-layer-type rope_parameters ({"full_attention": {...}, ...}), else []."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) or v is None for v in params.values()):
        return list(params)
    return []


def normalise_rope(cfg: "ModelConfig", layer_type: str | None) -> dict:
    """ModelConfig.rope_parameters, reading cfg.raw as transformers' standardize_rope_params does."""
    raw, file = cfg.raw, os.path.join(cfg.path, "config.json")
    nested = rope_layer_types(raw)
    if nested:
        if layer_type is None:
            raise CheckpointError(f"{file}: rope_parameters is given per layer type ({', '.join(nested)}), "
                                  f"but {cfg.architecture} has one RoPE for all layers")
        if raw["rope_parameters"].get(layer_type) is None:
            raise CheckpointError(f"{file}: rope_parameters has no entry for layer type {layer_type!r}")
        params = dict(raw["rope_parameters"][layer_type])
    elif layer_type == "sliding_attention" and "rope_local_base_freq" in raw:
        # transformers-4 Gemma 3: sliding layers use plain RoPE at their own base, rope_scaling is the global ones'
        params = {"rope_type": "default", "rope_theta": raw["rope_local_base_freq"]}
    else:
        params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        if not isinstance(params, dict):
            raise CheckpointError(f"{file}: rope_scaling / rope_parameters must be an object, got {params!r}")
        params = dict(params)
    kind = params.pop("type", None)
    kind = params.setdefault("rope_type", kind or "default")
    kind = params["rope_type"] = ROPE_ALIASES.get(kind, kind)
    if kind not in ROPE_KEYS:
        raise CheckpointError(f"{file}: rope scaling type {kind!r} is not supported "
                              f"(supported: {', '.join(ROPE_KEYS)})")
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    partial = raw.get("partial_rotary_factor", raw.get("rotary_pct"))
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if "original_max_position_embeddings" in ROPE_KEYS[kind][0]:
        # as transformers: a top-level value (Phi-3 keeps it there) wins, else the model's length
        if not nested and "original_max_position_embeddings" in raw:
            params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    required, _ = ROPE_KEYS[kind]
    for key in required:
        if key not in params:
            raise CheckpointError(f"{file}: rope type {kind!r} needs {key!r} in its rope parameters")
    if kind in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = cfg.max_position_embeddings / params["original_max_position_embeddings"]
    if kind == "longrope":   # pdserve's: the served length, which picks the factor set (layers/rotary.py)
        params["max_model_len"] = cfg.max_model_len or cfg.max_position_embeddings
    _check_rope(params, cfg.head_dim, f"{file}: rope parameters ({kind})")
    return params


def _check_rope(p: dict, head_dim: int, where: str):
    def number(key, low=0.0):
        v = p.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not low < v < float("inf")):
            raise CheckpointError(f"{where}: {key} must be a number > {low:g}, got {v!r}")

    for key in ("rope_theta", "factor", "attention_factor", "low_freq_factor", "high_freq_factor",
                "beta_fast", "beta_slow", "original_max_position_embeddings"):
        number(key)
    number("partial_rotary_factor")
    prf = p.get("partial_rotary_factor", 1.0)
    if prf > 1:
        raise CheckpointError(f"{where}: partial_rotary_factor must be in (0, 1], got {prf!r}")
    dim = int(head_dim * prf)
    if dim < 2 or dim % 2:
        raise CheckpointError(f"{where}: the rotary dim head_dim x partial_rotary_factor = {dim} must be even")
    if p["rope_type"] == "llama3" and p["high_freq_factor"] <= p["low_freq_factor"]:
        raise CheckpointError(f"{where}: high_freq_factor must be greater than low_freq_factor")
    for key in ("short_factor", "long_factor"):
        v = p.get(key)
        if p["rope_type"] == "longrope" and not (isinstance(v, list) and len(v) == dim // 2 and all(
                not isinstance(x, bool) and isinstance(x, (int, float)) and 0 < x < float("inf") for x in v)):
            raise CheckpointError(f"{where}: {key} must be {dim // 2} positive numbers (one per rotated pair)")


@dataclass
class EngineConfig:
    model: str
    dtype: str = option("auto", "weight and activation dtype; auto = the checkpoint's torch_dtype on GPU, float32 "
                        "on CPU (equal to transformers; bfloat16 is faster on CPUs with AVX512-BF16)",
                        choices=["auto", "float32", "bfloat16", "float16"])
    device: str | None = option(None, "cpu or cuda (default: cuda if available, else cpu)")
    gpu_memory_utilization: float = option(0.9, "CUDA: the fraction of the GPU's total memory this server may use "
                                           "(weights, activations and the KV cache, which gets what is left; "
                                           "--num-kv-blocks and --kv-cache-memory override it)", metavar="F")
    enforce_eager: bool = option(False, "CUDA: run every step eagerly, without the decode steps' CUDA graphs")
    block_size: int = option(16, "tokens per KV-cache block", min=1)
    num_kv_blocks: int | None = option(None, "number of KV-cache blocks (overrides --kv-cache-memory)", min=1)
    kv_cache_memory: int | None = option(None, "bytes of memory for the KV cache (default: enough for "
                                         "max-num-seqs full-length sequences, capped at 4 GiB)", min=1)
    max_num_batched_tokens: int = option(512, "token budget of one engine step (prefill chunks + decodes)", min=1)
    max_num_seqs: int = option(64, "most sequences in one engine step", min=1)
    # In a step that also decodes, at most this many prefill tokens in all (0: no cap; a step
    # without decodes still takes max_num_batched_tokens). Keeps running streams' ITL steady at a
    # cost in throughput and queued TTFT, so it is off by default (docs/PERFORMANCE.md).
    max_prefill_tokens_with_decodes: int = option(
        0, "in a step that also decodes, at most N prefill tokens in all, so a long prompt does not stall running "
        "streams (a step without decodes still takes the whole --max-num-batched-tokens); 0 = no cap",
        min=0, note=" (0 = no cap)", metavar="N")
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's "
                                       "max_position_embeddings)", min=1)
    seed: int = option(0, "seed for requests that give none")
    generation_config: str = option("auto", "default sampling of requests (temperature, top_p, top_k, min_p, "
                                    "repetition_penalty; max_new_tokens as max_tokens), as vLLM: auto = the model's "
                                    "generation_config.json, DIR = DIR/generation_config.json, vllm = ignore it; a "
                                    "request's own fields override (docs/API.md)", metavar="auto|vllm|DIR")
    quantization: str | None = option(None, "weight-only quantization at load, round-to-nearest (CPU kernels "
                                      "only): int8 = 8-bit codes, one scale per output channel; int4 = 4-bit codes, "
                                      "a scale and offset per 32 inputs (llama.cpp's Q4_1 grouping); the lm_head "
                                      "stays int8. A checkpoint already quantized keeps its own codes",
                                      choices=["int8", "int4"])
    cpu_kernels: bool | None = option(None, "CPU: linears, attention, norms and rotary on pdserve's own kernels "
                                      "(default: where they build: AVX2 or AVX-512 and a C++ compiler; "
                                      "PDSERVE_CPU_ISA=avx2|avx512 picks the build); --no-cpu-kernels uses torch's ops")
    threads: int | None = option(None, "CPU threads of the forward (default: the cores this process may use, its "
                                 "affinity mask); on a machine other work keeps busy, fewer can be much faster",
                                 min=1, metavar="N")
    profile_steps: int | None = option(None, "log where engine steps spend their time (schedule, prepare, "
                                       "forward, sample, output) every N steps", min=0, metavar="N")
    enable_prefix_caching: bool = option(
        True, "keep the K/V of computed prompt blocks and reuse them for any request whose prompt starts with the "
        "same tokens (a shared system prompt, a chat's history); --no-enable-prefix-caching turns it off")
    scheduling_policy: str = option("fcfs", "fcfs: arrival order; priority: by each request's priority (lower "
                                    "first), a waiting request may preempt lower-priority running ones; slo: "
                                    "prefills by TTFT slack, a step's prefill tokens sized to keep the tightest "
                                    "TPOT target, by a step-time model calibrated at start-up (seconds) and "
                                    "refitted from measured steps (docs/API.md)",
                                    choices=["fcfs", "priority", "slo"])
    slo_ttft_ms: float | None = option(None, "TTFT target (ms) of requests that give no slo.ttft_ms "
                                       "(default: none)", metavar="MS")
    slo_tpot_ms: float | None = option(None, "TPOT target (ms) of requests that give no slo.tpot_ms "
                                       "(default: none)", metavar="MS")
    slo_admission: str = option("serve", "slo policy: reject refuses at once (503 slo_unattainable) a request "
                                "whose TTFT target the step-time model says cannot be met; serve queues it anyway",
                                choices=["serve", "reject"])
    num_speculative_tokens: int = option(0, "speculative decoding: drafts proposed per sequence and step, verified "
                                         "in one forward (0 = off); by n-gram prompt lookup unless "
                                         "--speculative-model is given (docs/API.md)", min=0, metavar="K")
    speculative_model: str | None = option(None, "speculative decoding: a small draft model of the same tokenizer "
                                           "(checkpoint directory) proposes the drafts", metavar="DIR")
    speculative_config: str | None = option(None, "speculative decoding as vLLM's JSON: {\"method\": \"ngram\" | "
                                            "\"draft_model\", \"num_speculative_tokens\", \"prompt_lookup_min\", "
                                            "\"prompt_lookup_max\", \"model\"}; its keys override the two flags above",
                                            metavar="JSON")
    # prefill/decode disaggregation (pdserve/kv_transfer/, docs/API.md)
    role: str = option("both", "both: prefill and decode here (no KV transfer); prefill: also keep the prompt blocks of "
                       "kv_transfer_params.do_remote_decode requests for a decode worker to pull; decode: also admit "
                       "requests whose prompt KV is pulled from a prefill worker (kv_transfer_params.do_remote_prefill)",
                       choices=["both", "prefill", "decode"])
    kv_transport: str = option("tcp", "how a decode worker pulls the KV: tcp (framed, checksummed; between machines) or "
                               "shm (shared memory, both workers on one host); set on the prefill worker",
                               choices=["tcp", "shm"])
    kv_transfer_host: str = option("127.0.0.1", "prefill role: address the KV listener binds and advertises "
                                   "(0.0.0.0: every interface, advertised as this host's address)", metavar="HOST")
    kv_transfer_port: int = option(0, "prefill role: TCP port of the KV listener (0: any free port; GET /v1/kv_transfer "
                                   "says which)", min=0, metavar="PORT")
    kv_lease_s: float = option(60.0, "prefill role: seconds a finished request's prompt blocks are kept for a decode "
                               "worker to pull before they are freed", metavar="SECONDS")
    kv_transfer_secret: str | None = option(None, "prefill and decode roles: the deployment's secret, the same on "
                                            "every worker, that authenticates the KV channel (default: the "
                                            "PDSERVE_KV_TRANSFER_SECRET environment variable, which ps does not "
                                            "show; serve --disaggregate and --ray make one)", repr=False,
                                            metavar="SECRET")
    kv_transfer_peers: str | None = option(None, "decode role: the only KV listeners (HOST:PORT,...) this worker "
                                           "pulls from (default: any that signed params with the secret name)",
                                           metavar="HOST:PORT,...")
    kv_engine_id: str | None = option(None, "this worker's engine id on the KV channel, which leases are made for "
                                      "(default: a random one; a Ray decode pool shares one)", metavar="ID")
    kv_load_failure_policy: str = option("recompute", "decode role: when pulling a prompt's KV fails, recompute the "
                                         "prompt here, or fail the request", choices=["recompute", "fail"])

    def __post_init__(self):
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device cuda was asked for but torch sees no CUDA device")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.max_prefill_tokens_with_decodes, int) or self.max_prefill_tokens_with_decodes < 0:
            raise ConfigError(f"max_prefill_tokens_with_decodes must be >= 0 (0 = no cap), "
                             f"got {self.max_prefill_tokens_with_decodes!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.scheduling_policy not in ("fcfs", "priority", "slo"):
            raise ConfigError(f"scheduling_policy must be fcfs, priority or slo, got {self.scheduling_policy!r}")
        if self.slo_admission not in ("serve", "reject"):
            raise ConfigError(f"slo_admission must be serve or reject, got {self.slo_admission!r}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not 0 < v < float("inf"):
                raise ConfigError(f"{name} must be a number of milliseconds > 0, got {v!r}")
        if self.role not in ("both", "prefill", "decode"):
            raise ConfigError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.kv_transport not in ("tcp", "shm"):
            raise ConfigError(f"kv_transport must be tcp or shm, got {self.kv_transport!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(f"kv_load_failure_policy must be recompute or fail, got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_transfer_port, int) or not 0 <= self.kv_transfer_port < 65536:
            raise ConfigError(f"kv_transfer_port must be a TCP port (0: any free one), got {self.kv_transfer_port!r}")
        from pdserve.kv_transfer.auth import parse_peers, secret_from
        self.kv_transfer_secret = secret_from(self.kv_transfer_secret)
        try:
            parse_peers(self.kv_transfer_peers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.role != "both" and not self.kv_transfer_secret:
            raise ConfigError(f"--role {self.role} needs the deployment's KV transfer secret, the same on every "
                              "prefill and decode worker: set PDSERVE_KV_TRANSFER_SECRET (or --kv-transfer-secret), "
                              "e.g. to the output of `python -c 'import secrets; print(secrets.token_hex(32))'`")
        if not 0 < self.kv_lease_s < float("inf"):
            raise ConfigError(f"kv_lease_s must be a number of seconds > 0, got {self.kv_lease_s!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if self.quantization not in (None, "int8", "int4"):
            raise ConfigError(f"quantization must be int8, int4 or unset, got {self.quantization!r}")
        if self.quantization and (self.device != "cpu" or self.cpu_kernels is False):
            raise ConfigError(f"--quantization {self.quantization} runs on pdserve's CPU linear kernels: it needs "
                             "--device cpu and --cpu-kernels")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must be able to decode in every step, or some would stall
            logging.getLogger("pdserve").warning("max_num_seqs %d capped at max_num_batched_tokens %d",
                                                 self.max_num_seqs, self.max_num_batched_tokens)
            self.max_num_seqs = self.max_num_batched_tokens
        self.speculative()   # checked here, so a bad value fails before anything loads
        self.generation_defaults()   # likewise: a missing DIR or a bad value in the file

    def generation_defaults(self):
        """The default sampling of requests (pdserve/generation_config.py)."""
        from pdserve.generation_config import load_generation_defaults
        return load_generation_defaults(self.generation_config, self.model)

    def speculative(self):
        """The speculative decoding asked for (pdserve/spec_decode/config.py), or None."""
        from pdserve.spec_decode.config import speculative_config
        return speculative_config(self.num_speculative_tokens, self.speculative_model, self.speculative_config)

    def torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        if self.dtype == "auto":
            # On CPU auto means fp32: results equal transformers'; bf16 (faster with AVX512-BF16,
            # docs/PERFORMANCE.md) is asked for explicitly.
            if self.device == "cpu":
                return torch.float32
            return getattr(torch, model_config.torch_dtype or "float32", torch.float32)
        return getattr(torch, self.dtype)
