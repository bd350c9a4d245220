"""ModelConfig's sizes from each family's config.json, with transformers' defaults where a key is
missing: what transformers keeps in its configuration_<family>.py, apart from the model code
(pdserve/models/), so reading a checkpoint's config needs no model class. A missing required key
raises KeyError (ModelConfig.from_dir names it). The architectures pdserve serves are this table's
keys, the same as models.ARCHITECTURES' (a test holds them equal)."""


def llama(raw: dict) -> dict:
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    return dict(vocab_size=raw["vocab_size"], hidden_size=hidden, num_layers=raw["num_hidden_layers"],
                num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or hidden // heads, intermediate_size=raw["intermediate_size"],
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                tie_word_embeddings=raw.get("tie_word_embeddings", False))


def opt(raw: dict) -> dict:
    """No grouped KV heads; the MLP width is ffn_dim."""
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    return dict(vocab_size=raw["vocab_size"], hidden_size=hidden, num_layers=raw["num_hidden_layers"],
                num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=raw["ffn_dim"],
                max_position_embeddings=raw["max_position_embeddings"],
                tie_word_embeddings=raw.get("tie_word_embeddings", True))


def gemma2(raw: dict) -> dict:
    return llama(raw) | dict(num_kv_heads=raw.get("num_key_value_heads") or 4, head_dim=raw.get("head_dim") or 256,
                             max_position_embeddings=raw.get("max_position_embeddings", 8192),
                             tie_word_embeddings=raw.get("tie_word_embeddings", True))


def gemma3(raw: dict) -> dict:
    return gemma2(raw) | dict(max_position_embeddings=raw.get("max_position_embeddings", 131072))


def phi3(raw: dict) -> dict:
    return llama(raw) | dict(max_position_embeddings=raw.get("max_position_embeddings", 4096))


def qwen3(raw: dict) -> dict:
    return llama(raw) | dict(head_dim=raw.get("head_dim") or 128,
                             max_position_embeddings=raw.get("max_position_embeddings", 32768))


def smollm3(raw: dict) -> dict:
    return llama(raw) | dict(max_position_embeddings=raw.get("max_position_embeddings", 32768),
                             tie_word_embeddings=raw.get("tie_word_embeddings", True))


def ministral(raw: dict) -> dict:
    return llama(raw) | dict(max_position_embeddings=raw.get("max_position_embeddings", 4096 * 32))


def ministral3(raw: dict) -> dict:
    fields = llama(raw)
    # transformers' defaults differ from pdserve's (a yarn RoPE among them): a config.json
    # without its RoPE parameters is refused as missing them, never served with plain RoPE
    if not (raw.get("rope_parameters") or raw.get("rope_scaling")):
        raise KeyError("rope_parameters")
    return fields | dict(head_dim=raw.get("head_dim") or 128,
                         max_position_embeddings=raw.get("max_position_embeddings", 262144))


def qwen2_moe(raw: dict) -> dict:
    return llama(raw) | dict(max_position_embeddings=raw.get("max_position_embeddings", 32768))


def mixtral(raw: dict) -> dict:
    # transformers' Mixtral default base, where config.json gives none (rope_parameters' own wins)
    if "rope_theta" not in raw:
        raw["rope_theta"] = 1e6
    return llama(raw) | dict(max_position_embeddings=raw.get("max_position_embeddings", 4096 * 32))


def deepseek_v3(raw: dict) -> dict:
    """head_dim is the rotated part of a head (qk_rope_head_dim), as transformers sets it: the size
    RoPE's tables are made for."""
    heads = raw.get("num_attention_heads", 128)
    return dict(vocab_size=raw.get("vocab_size", 129280), hidden_size=raw.get("hidden_size", 7168),
                num_layers=raw.get("num_hidden_layers", 61), num_heads=heads,
                num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=raw.get("qk_rope_head_dim", 64),
                intermediate_size=raw.get("intermediate_size", 18432),
                max_position_embeddings=raw.get("max_position_embeddings", 4096),
                tie_word_embeddings=raw.get("tie_word_embeddings", False))


def gpt_oss(raw: dict) -> dict:
    # transformers' GptOssConfig defaults, where config.json gives none
    if "rope_theta" not in raw and "rope_theta" not in (raw.get("rope_parameters") or {}):
        raw["rope_theta"] = 150000.0
    return llama(raw) | dict(head_dim=raw.get("head_dim") or 64,
                             max_position_embeddings=raw.get("max_position_embeddings", 131072))


# HF architecture name -> its config.json reader
CONFIG_FIELDS = {
    "LlamaForCausalLM": llama,
    "Qwen2ForCausalLM": llama,
    "MistralForCausalLM": llama,
    "OPTForCausalLM": opt,
    "Gemma2ForCausalLM": gemma2,
    "Gemma3ForCausalLM": gemma3,
    "Phi3ForCausalLM": phi3,
    "Qwen3ForCausalLM": qwen3,
    "Olmo2ForCausalLM": llama,
    "GraniteForCausalLM": llama,
    "SmolLM3ForCausalLM": smollm3,
    "MinistralForCausalLM": ministral,
    "Ministral3ForCausalLM": ministral3,
    "Qwen2MoeForCausalLM": qwen2_moe,
    "Qwen3MoeForCausalLM": qwen2_moe,
    "MixtralForCausalLM": mixtral,
    "DeepseekV3ForCausalLM": deepseek_v3,
    "GptOssForCausalLM": gpt_oss,
}
