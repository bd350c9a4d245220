"""The text part of vision-language checkpoints: Gemma3ForConditionalGeneration (Gemma 3 4B, 12B, 27B)
and Mistral3ForConditionalGeneration (Mistral Small 3.1, Ministral 3), served as vLLM serves them for
text prompts: the language model exactly, the vision tower and projector never read.

Such a config.json nests the language model's config under text_config (often sparse: the Hub's
Gemma 3 4B gives six keys), beside vision_config. text_raw() turns it into the text family's
config.json: the text_config's keys over the defaults of the text config class transformers
instantiates for it (a dict without model_type gets the composite's default type), and the top-level
fields transformers reads on the composite model: dtype, quantization_config, tie_word_embeddings
(the composite's, default true; as transformers, an lm_head tensor in the checkpoint is loaded
rather than tied). text_weight_name() maps the checkpoint's names (transformers-5's
language_model.model.* / language_model.lm_head.*, or transformers-4.5x's model.language_model.* /
lm_head.*) onto the text model's and drops the vision tower's and projector's before they are read."""
import json
import os

from pdserve.checkpoint_files import checkpoint_file
from pdserve.errors import CheckpointError

# composite architecture -> (its text_config's default model_type, {text model_type -> pdserve architecture},
# the text config keys its forward overrides): transformers' Gemma3ForConditionalGeneration returns the
# lm_head's logits uncapped whatever final_logit_softcapping says (the Hub's Gemma 3 sets none)
VLM_TEXT = {
    "Gemma3ForConditionalGeneration": ("gemma3_text", {"gemma3_text": "Gemma3ForCausalLM"},
                                       {"final_logit_softcapping": None}),
    "Mistral3ForConditionalGeneration": ("mistral", {"mistral": "MistralForCausalLM",
                                                     "ministral3": "Ministral3ForCausalLM"}, {}),
}

# transformers 5.23's text config class defaults (Gemma3TextConfig, MistralConfig, Ministral3Config) for the
# keys a sparse text_config may leave out and the text families read (tests/models check them against
# transformers); head_dim is derived where transformers derives it (Mistral: hidden / heads)
TEXT_DEFAULTS = {
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
                        sliding_window=4096, query_pre_attn_scalar=256, attention_bias=False,
                        final_logit_softcapping=None, attn_logit_softcapping=None),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                    max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=4096),
    "ministral3": dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=34,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                       max_position_embeddings=262144, rms_norm_eps=1e-5, sliding_window=None,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                        "original_max_position_embeddings": 16384,
                                        "max_position_embeddings": 262144, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}),
}

# checkpoint prefix -> the text model's (None: not read)
PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."), ("lm_head.", "lm_head."),
            ("vision_tower.", None), ("multi_modal_projector.", None),
            ("model.vision_tower.", None), ("model.multi_modal_projector.", None))


def text_raw(raw: dict, file: str, tensor_names: set[str] | None) -> dict:
    """The text family's config.json for a composite `raw` (architecture in VLM_TEXT); tensor_names:
    the checkpoint's tensor names (None: no weights to look at), which decide the tie."""
    arch = next(a for a in raw["architectures"] if a in VLM_TEXT)
    default_type, families, forward = VLM_TEXT[arch]
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{file}: {arch} needs its language model's config as text_config (an object)")
    kind = text.get("model_type", default_type)
    if kind not in families:
        raise CheckpointError(f"{file}: {arch} with a text_config of model_type {kind!r} is not supported "
                              f"(supported: {', '.join(families)})")
    merged = dict(TEXT_DEFAULTS[kind])
    if "rope_scaling" in text:   # transformers-4's spelling: the default rope_parameters must not shadow it
        merged.pop("rope_parameters", None)
    merged.update(text, **forward, model_type=kind, architectures=[families[kind]])
    for key in ("dtype", "torch_dtype", "quantization_config"):
        if key in raw:
            merged[key] = raw[key]
    has_head = tensor_names is not None and any(text_weight_name(n) == "lm_head.weight" for n in tensor_names)
    merged["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True)) and not has_head
    return merged


def text_weight_name(name: str) -> str | None:
    """The text model's name for a checkpoint tensor; None for the vision tower's and projector's.
    A name under none of the prefixes is kept (the loader refuses it as unexpected)."""
    for prefix, to in PREFIXES:
        if name.startswith(prefix):
            return None if to is None else to + name[len(prefix):]
    return name


def checkpoint_tensor_names(path: str) -> set[str] | None:
    """The tensor names of an HF checkpoint directory, from the shard index or the safetensors
    header (no tensor is read); None where it has no safetensors yet (the loader says so later)."""
    from safetensors import safe_open
    index = checkpoint_file(path, "model.safetensors.index.json")
    single = checkpoint_file(path, "model.safetensors")
    try:
        if os.path.isfile(index):
            with open(index) as f:
                return set(json.load(f)["weight_map"])
        if os.path.isfile(single):
            with safe_open(single, framework="pt") as f:
                return set(f.keys())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header or index ({e})") from None
    return None
