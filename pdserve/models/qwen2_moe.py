"""Qwen2-MoE (transformers' Qwen2MoeForCausalLM: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v
biases by `qkv_bias`), experts in every decoder_sparse_step-th layer outside mlp_only_layers
(dense MLPs elsewhere), softmax top-k routing renormalised where norm_topk_prob says, and a shared
expert every token goes through, gated by sigmoid(shared_expert_gate(x)).

Windows as transformers' Qwen2-MoE sets them: config.json's layer_types, else the even layers below
max_window_layers slide, each only with use_sliding_window."""
from dataclasses import replace

from torch import nn

from pdserve.config import ModelConfig
from pdserve.layers.moe import SparseMoeBlock
from pdserve.models.llama import LlamaMLP, LlamaVariant, refuse, swiglu_variant, windows_of
from pdserve.models.moe_llama import MoEDecoderLayer, MoEForCausalLM, num_experts_of, non_negative_int, routing_of, sparse_layers


def qwen2_moe_windows(cfg: ModelConfig) -> tuple[int | None, ...]:
    raw = cfg.raw
    use = bool(raw.get("use_sliding_window", False))
    types = raw.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 and i < raw.get("max_window_layers", 28) and use else "full_attention"
        for i in range(cfg.num_layers)]
    if not use and "sliding_attention" in types:   # transformers' window is then 0
        refuse(cfg, "layer_types has sliding_attention layers but use_sliding_window is false")
    return windows_of(cfg, raw.get("sliding_window", 4096) if use else None, types)


class Qwen2MoeDecoderLayer(MoEDecoderLayer):
    @staticmethod
    def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
        E = num_experts_of(cfg, 60, keys=("num_experts",))
        if not sparse_layers(cfg, E)[layer]:
            return LlamaMLP(cfg)
        raw = cfg.raw
        shared = non_negative_int(cfg, "shared_expert_intermediate_size", 5632)
        return SparseMoeBlock(cfg.hidden_size, routing_of(cfg, E, bool(raw.get("norm_topk_prob", False))),
                              non_negative_int(cfg, "moe_intermediate_size", 1408),
                              shared_expert=LlamaMLP(cfg, shared), shared_expert_gate=True)


class Qwen2MoeForCausalLM(MoEForCausalLM):
    layer_class = Qwen2MoeDecoderLayer

    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        return replace(swiglu_variant(cfg, qwen2_moe_windows(cfg)), qkv_bias=bool(cfg.raw.get("qkv_bias", True)),
                       o_bias=False)
