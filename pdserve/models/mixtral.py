"""Mixtral (transformers' MixtralForCausalLM: Mixtral 8x7B, 8x22B): Mistral's attention (no biases,
the config's sliding_window on every layer), experts in every layer (`block_sparse_moe`: w1 the
gate, w3 the up, w2 the down projection), softmax top-k routing always renormalised, no shared
expert. transformers' defaults: rms_norm_eps 1e-5, rope_theta 1e6."""
from dataclasses import replace

from torch import nn

from pdserve.config import ModelConfig
from pdserve.layers.moe import SparseMoeBlock
from pdserve.models.llama import LlamaVariant, swiglu_variant, windows_of
from pdserve.models.moe_llama import MoEDecoderLayer, MoEForCausalLM, num_experts_of, routing_of


class MixtralDecoderLayer(MoEDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, norm, variant: LlamaVariant | None = None):
        super().__init__(cfg, layer, norm, variant)
        self.block_sparse_moe = self._modules.pop("mlp")   # the checkpoint's name for it

    @property
    def mlp(self) -> nn.Module:   # what LlamaDecoderLayer.forward calls
        return self.block_sparse_moe

    @staticmethod
    def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
        E = num_experts_of(cfg, 8)
        return SparseMoeBlock(cfg.hidden_size, routing_of(cfg, E, renormalize=True), cfg.intermediate_size)


class MixtralForCausalLM(MoEForCausalLM):
    layer_class = MixtralDecoderLayer
    expert_names = ("w1", "w3", "w2")

    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        window = cfg.raw.get("sliding_window")
        v = swiglu_variant(cfg, windows_of(cfg, window, ["sliding_attention"] * cfg.num_layers))
        return replace(v, qkv_bias=False, o_bias=False, eps=float(cfg.raw.get("rms_norm_eps", 1e-5)))
