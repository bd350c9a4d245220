"""Qwen3 (transformers' Qwen3ForCausalLM): a Llama with an RMSNorm of each head of q and k before
RoPE, an explicit head_dim, no q/k/v bias, and Qwen2's sliding-window layers."""
from dataclasses import replace

from pdserve.config import ModelConfig
from pdserve.models.llama import LlamaForCausalLM, LlamaVariant, swiglu_variant, windows_of


def qwen_windows(cfg: ModelConfig) -> tuple[int | None, ...]:
    """Qwen2's and Qwen3's rule: no window unless use_sliding_window; the windowed layers are the
    config's layer_types, or (transformers-4 configs have none) those from max_window_layers on."""
    raw = cfg.raw
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    types = raw.get("layer_types") or [
        "sliding_attention" if window is not None and i >= raw.get("max_window_layers", 28) else "full_attention"
        for i in range(cfg.num_layers)]
    return windows_of(cfg, window, types)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def config_fields(raw: dict) -> dict:
        fields = LlamaForCausalLM.config_fields(raw)
        # transformers' defaults where config.json says nothing
        return dict(fields, head_dim=raw.get("head_dim") or 128,
                    max_position_embeddings=raw.get("max_position_embeddings", 32768))

    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        return replace(swiglu_variant(cfg, qwen_windows(cfg)), qk_norm="head")
