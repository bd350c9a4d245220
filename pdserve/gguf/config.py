"""The HF-style config.json of a GGUF file, built from its metadata.

llama.cpp's converter writes each family's sizes under `<architecture>.*` keys
(gguf-py/gguf/constants.py's Keys.LLM / Keys.Attention / Keys.Rope); this maps them back to the
config.json fields pdserve's model classes read (ModelConfig.raw), for the architectures whose
GGUF form pdserve can serve exactly. Anything the metadata says that pdserve's config cannot
express (a rope scaling it does not read, llama3 rope factors stored as a tensor, a sliding
window without its layer pattern) is refused in one line rather than served differently."""
import numpy as np
from gguf import GGMLQuantizationType as T

from pdserve.errors import CheckpointError
from pdserve.gguf.reader import GGUFFile

# general.architecture -> (HF architecture, model_type). llama.cpp writes Mistral as "llama" (served as
# Llama: the same model without a sliding window, which its GGUF cannot express).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "granite": ("GraniteForCausalLM", "granite"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
}
# Granite's multipliers: GGUF key -> config.json field
GRANITE_SCALES = {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                  "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
DTYPES = {T.F32: "float32", T.F16: "float16", T.BF16: "bfloat16"}
# the architectures whose attention.sliding_window is read (gemma_fields; Phi-3's below): refused elsewhere
WINDOWED = {"gemma2", "gemma3", "phi3"}


def hf_config(f: GGUFFile) -> dict:
    """config.json's fields for the file's model; a one-line CheckpointError for what pdserve cannot serve."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{f.path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    hf_arch, model_type = ARCHITECTURES[arch]

    def need(key):
        v = f.arch_get(key)
        if v is None:
            raise CheckpointError(f"{f.path}: metadata {arch}.{key} is missing")
        return v

    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise CheckpointError(f"{f.path}: no token_embd.weight tensor")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = f.arch_get("attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise CheckpointError(f"{f.path}: per-layer head counts are not supported")
    head_dim = int(f.arch_get("attention.key_length", hidden // heads))
    if int(f.arch_get("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{f.path}: key and value head sizes differ, which {hf_arch} does not have")
    rope_dim = int(f.arch_get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(f"{f.path}: rope.dimension_count {rope_dim} differs from the head size {head_dim} "
                              f"(partial rotary), which {hf_arch} does not have")
    if "rope_freqs.weight" in f.tensors:
        raise CheckpointError(f"{f.path}: rope frequency factors stored as the tensor rope_freqs.weight "
                              "(llama3/longrope scaling) are not supported")
    if f.arch_get("attention.sliding_window") is not None and arch not in WINDOWED:
        raise CheckpointError(f"{f.path}: {arch}.attention.sliding_window is set; a {hf_arch} GGUF with a sliding "
                              "window is not supported")
    raw = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": int(embd.shape[1]), "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(kv_heads), "head_dim": head_dim,
        "intermediate_size": int(need("feed_forward_length")),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": f32(f.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "rope_parameters": rope_parameters(f),
        "dtype": DTYPES.get(_main_type(f)),
    }
    if model_type in ("qwen2", "qwen3"):
        raw["use_sliding_window"] = False
    if model_type == "granite":
        for key, name in GRANITE_SCALES.items():
            if f.arch_get(key) is not None:
                raw[name] = f32(f.arch_get(key))
    if arch in GEMMA:
        raw.update(gemma_fields(f, raw))
    if model_type == "smollm3":
        # llama.cpp's smollm3 (src/models/smollm3.cpp): every 4th layer without RoPE, no window
        raw.update(no_rope_layer_interval=4, use_sliding_window=False)
    if model_type == "phi3":
        # every layer's window, as transformers' Phi-3 masks them (the converter writes 0 for none:
        # Phi-4); llama.cpp turns Phi's window off, and so differs from it past the window
        raw["sliding_window"] = int(f.arch_get("attention.sliding_window", 0)) or None
        raw["rope_parameters"]["partial_rotary_factor"] = 1.0   # partial rotary is refused above
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        raw[key] = f.get(f"tokenizer.ggml.{name}_token_id")
    return raw


# Gemma's GGUF as llama.cpp's loaders read it (src/models/gemma2.cpp, gemma3.cpp): the default layer
# pattern (every n-th layer global), the layer count of the 27B model, whose attention scale is
# 1/sqrt(hidden / heads) (the others': 1/sqrt(head size)), and the local layers' RoPE base where the
# file has none (Gemma 2: the global one's)
GEMMA = {"gemma2": dict(pattern=2, big_layers=46, local_base=None),
         "gemma3": dict(pattern=6, big_layers=62, local_base=10000.0)}


def gemma_fields(f: GGUFFile, raw: dict) -> dict:
    """What a Gemma 2 or 3 GGUF means as llama.cpp reads it, in config.json's fields: local layers by
    attention.sliding_window_pattern (a list of flags, or n: every n-th layer global; GEMMA's n where
    absent) with attention.sliding_window (Gemma 3: none without it; Gemma 2: 4096 where absent); the
    local layers' RoPE base rope.freq_base_swa, unscaled; the attention scale; the soft caps the file has."""
    arch, n = f.architecture, raw["num_hidden_layers"]
    g = GEMMA[arch]
    window = f.arch_get("attention.sliding_window", 4096 if arch == "gemma2" else None)
    local = [False] * n
    if window:
        pattern = f.arch_get("attention.sliding_window_pattern", g["pattern"])
        if isinstance(pattern, list):
            if len(pattern) != n:
                raise CheckpointError(f"{f.path}: attention.sliding_window_pattern has {len(pattern)} flags "
                                      f"for {n} layers")
            local = [bool(x) for x in pattern]
        else:   # llama.cpp's set_swa_pattern: 0 is every layer local
            pattern = int(pattern)
            local = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]
    fields = {"layer_types": ["sliding_attention" if x else "full_attention" for x in local],
              "sliding_window": int(window) if window else None, "hidden_activation": "gelu_pytorch_tanh",
              "query_pre_attn_scalar": raw["hidden_size"] // raw["num_attention_heads"] if n == g["big_layers"]
              else raw["head_dim"]}
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        value = f.arch_get(cap)
        fields[cap] = f32(value) if value else None
    local_base = f.arch_get("rope.freq_base_swa", g["local_base"])
    if arch == "gemma2":
        if local_base is not None and f32(local_base) != raw["rope_parameters"]["rope_theta"]:
            raise CheckpointError(f"{f.path}: gemma2.rope.freq_base_swa {local_base} differs from the global "
                                  "RoPE base, which Gemma 2 does not have")
    elif any(local):
        fields["rope_parameters"] = {"full_attention": raw["rope_parameters"],
                                     "sliding_attention": {"rope_type": "default", "rope_theta": f32(local_base)}}
    else:
        fields["rope_parameters"] = {"full_attention": raw["rope_parameters"]}
    return fields


def f32(x) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32 (1e-6, not
    9.999999974752427e-07): what config.json said before the converter stored it as float32."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def rope_parameters(f: GGUFFile) -> dict:
    params = {"rope_type": "default", "rope_theta": f32(f.arch_get("rope.freq_base", 10000.0))}
    kind = f.arch_get("rope.scaling.type", "none")
    if kind == "linear":
        params.update(rope_type="linear", factor=f32(f.arch_get("rope.scaling.factor")))
    elif kind != "none":
        raise CheckpointError(f"{f.path}: rope scaling {kind!r} in GGUF metadata is not supported (supported: linear)")
    return params


def _main_type(f: GGUFFile):
    """The type of the file's linear weights (that of its first attention query)."""
    t = f.tensors.get("blk.0.attn_q.weight") or f.tensors.get("blk.0.attn_qkv.weight")
    return None if t is None else t.tensor_type
