"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): Qwen3's
attention (an RMSNorm of each head of q and k before RoPE, `attention_bias` on q, k, v and o),
experts in every decoder_sparse_step-th layer outside mlp_only_layers (dense MLPs elsewhere),
softmax top-k routing renormalised where norm_topk_prob says, no shared expert. With
use_sliding_window every layer has the window (transformers' Qwen3-MoE has no layer_types)."""
from dataclasses import replace

from torch import nn

from pdserve.config import ModelConfig
from pdserve.layers.moe import SparseMoeBlock
from pdserve.models.llama import LlamaMLP, LlamaVariant, swiglu_variant, windows_of
from pdserve.models.moe_llama import MoEDecoderLayer, MoEForCausalLM, num_experts_of, non_negative_int, routing_of, sparse_layers


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    @staticmethod
    def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
        E = num_experts_of(cfg, 128)
        if not sparse_layers(cfg, E)[layer]:
            return LlamaMLP(cfg)
        return SparseMoeBlock(cfg.hidden_size, routing_of(cfg, E, bool(cfg.raw.get("norm_topk_prob", False))),
                              non_negative_int(cfg, "moe_intermediate_size", 768))


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_class = Qwen3MoeDecoderLayer

    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        raw = cfg.raw
        window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
        bias = bool(raw.get("attention_bias", False))
        v = swiglu_variant(cfg, windows_of(cfg, window, ["sliding_attention"] * cfg.num_layers))
        return replace(v, qkv_bias=bias, o_bias=bias, qk_norm="head")
