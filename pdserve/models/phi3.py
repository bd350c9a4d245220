"""Phi-3 (Phi3ForCausalLM: Phi-3-mini, Phi-3.5-mini, Phi-4-mini, Phi-4).

Llama's layers exactly (its dropouts are training-only): what differs is in the checkpoint and the
config. The checkpoint keeps q/k/v as one qkv_proj and gate/up as one gate_up_proj, in the order
of our merged linears, so each fills its MergedLinear whole. Every layer has the config's
sliding_window if it sets one (transformers' Phi-3 masks all layers by it: Phi-3-mini-4k's 2047).
RoPE: longrope (Phi-3-*-128k, Phi-3.5, Phi-4-mini) and partial rotary (partial_rotary_factor,
Phi-4-mini's 0.75) as layers/rotary.py computes them."""
import os

from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.layers.attention import PagedAttention
from pdserve.layers.layernorm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # the checkpoint's fused tensors, each our merged linear whole (shard None): the loader then
    # requires them as it requires any parameter
    stacked_params = {"qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None)}

    def __init__(self, cfg: ModelConfig):
        raw, file = cfg.raw, os.path.join(cfg.path, "config.json")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{file}: hidden_act {raw['hidden_act']!r} is not supported (supported: silu)")
        params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        if params.get("rope_type", params.get("type")) == "yarn":
            # transformers' Phi-3 reads it as longrope (a name of its first releases); YaRN it is not
            raise CheckpointError(f"{file}: rope type 'yarn' means longrope to Phi-3; give it as longrope")
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        rotary_dim = int(cfg.head_dim * partial)
        super().__init__(cfg)
        window, eps = raw.get("sliding_window"), raw.get("rms_norm_eps", 1e-5)   # Phi3Config's defaults
        for m in self.modules():
            if isinstance(m, PagedAttention):
                m.sliding_window = window    # every layer's: transformers' Phi-3 has no layer_types
            elif isinstance(m, RMSNorm):
                m.eps = eps
        if rotary_dim != cfg.head_dim:
            self.model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                                cfg.rope_scaling, rotary_dim=rotary_dim)
