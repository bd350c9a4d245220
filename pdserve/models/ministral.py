"""Ministral (transformers' MinistralForCausalLM, Ministral 8B): a Mistral whose layer_types mix
sliding-window and full-attention layers. Ministral 3 (transformers' Ministral3ForCausalLM, the
text model of Mistral 3 / Ministral 3): yarn RoPE, and q scaled by position after RoPE (Llama 4's
llama_4_scaling_beta), one sliding window (or none) for every layer.

The Hub ships Ministral 3 and Mistral 3 as Mistral3ForConditionalGeneration (a Pixtral vision
tower, a projector and this text model under model.language_model, its config.json's text_config):
pdserve serves its text part (pdserve/vlm_text.py)."""
from dataclasses import replace

from pdserve.config import ModelConfig
from pdserve.models.llama import LlamaForCausalLM, LlamaVariant, refuse, swiglu_variant, windows_of


class MinistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        # no q/k/v bias whatever attention_bias says; a window of 4096 where config.json has no
        # key, on every layer where it has no layer_types (MinistralConfig's defaults)
        window = cfg.raw.get("sliding_window", 4096)
        types = cfg.raw.get("layer_types") or ["sliding_attention"] * cfg.num_layers
        return replace(swiglu_variant(cfg, windows_of(cfg, window, types)), qkv_bias=False, o_bias=False)


class Ministral3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        params = cfg.raw.get("rope_parameters") or cfg.raw.get("rope_scaling")
        beta, period = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
        if not isinstance(beta, (int, float)) or not isinstance(period, int) or period < 1:
            # transformers' Ministral 3 needs both (it fails without them)
            refuse(cfg, "rope_parameters needs llama_4_scaling_beta (a number) and "
                        f"original_max_position_embeddings (a positive integer), got {beta!r} and {period!r}")
        # layer_types are ignored (transformers warns): one window, or none, for every layer
        window = cfg.raw.get("sliding_window")
        return replace(swiglu_variant(cfg, windows_of(cfg, window, ["sliding_attention"] * cfg.num_layers)),
                       qkv_bias=False, o_bias=False, eps=float(cfg.raw.get("rms_norm_eps", 1e-5)),
                       query_scale=(float(beta), period))
