"""Qwen3 (transformers' Qwen3ForCausalLM): a Llama with an RMSNorm of each head of q and k before
RoPE, an explicit head_dim, no q/k/v bias, and Qwen2's sliding-window layers."""
from dataclasses import replace

from pdserve.config import ModelConfig
from pdserve.models.llama import LlamaForCausalLM, LlamaVariant, swiglu_variant, windows_of


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        # Qwen2's window rule (config.py), each type checked here
        return replace(swiglu_variant(cfg, windows_of(cfg, cfg.sliding_window, cfg.layer_types)), qk_norm="head")
