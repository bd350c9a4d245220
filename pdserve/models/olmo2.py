"""OLMo 2 (transformers' Olmo2ForCausalLM): no norm before the blocks; each block's output is
normed (post_attention_layernorm, post_feedforward_layernorm) before it joins the stream, and q
and k are normed over their whole projections (H x head_dim, Hkv x head_dim) before RoPE."""
from dataclasses import replace

import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.layers.rotary import Rope
from pdserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaVariant, swiglu_variant


class Olmo2DecoderLayer(nn.Module):
    # the recipe's norms (models/decoder_spec.py): none before the blocks, one on each block's output
    norms = dict(attn_norm=None, mlp_norm=None, post_attn_norm="post_attention_layernorm",
                 post_mlp_norm="post_feedforward_layernorm")

    def __init__(self, cfg: ModelConfig, layer: int, norm, variant: LlamaVariant):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, variant, norm)
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = norm(cfg.hidden_size, variant.eps)
        self.post_feedforward_layernorm = norm(cfg.hidden_size, variant.eps)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, q_scale=None):
        """As LlamaDecoderLayer's: x is the previous layer's output, not yet added to the stream."""
        if residual is not None:
            x = x + residual
        h = x + self.post_attention_layernorm(self.self_attn(rope, x, q_scale))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_class = Olmo2DecoderLayer

    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        # Olmo2Config has no sliding window; its eps defaults to 1e-5
        return replace(swiglu_variant(cfg, (None,) * cfg.num_layers), qk_norm="proj",
                       eps=float(cfg.raw.get("rms_norm_eps", 1e-5)))
