"""Granite 3.x dense (transformers' GraniteForCausalLM): a Llama with four multipliers from
config.json: the embeddings are scaled by embedding_multiplier, attention scores by
attention_multiplier (instead of head_dim ** -0.5), each block's output by residual_multiplier as
it joins the stream, and the logits are divided by logits_scaling."""
from dataclasses import replace

from pdserve.config import ModelConfig
from pdserve.models.llama import LlamaForCausalLM, LlamaVariant, refuse, swiglu_variant


class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        m = {k: cfg.raw.get(k, 1.0) for k in ("embedding_multiplier", "attention_multiplier",
                                              "residual_multiplier", "logits_scaling")}
        for k, x in m.items():
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                refuse(cfg, f"{k} must be a number, got {x!r}")
        if m["logits_scaling"] <= 0:   # the greedy argmax is taken before the scaling: it must keep the order
            refuse(cfg, f"logits_scaling must be > 0, got {m['logits_scaling']!r}")
        # GraniteConfig has no sliding window
        return replace(swiglu_variant(cfg, (None,) * cfg.num_layers),
                       embedding_multiplier=float(m["embedding_multiplier"]),
                       attention_scale=float(m["attention_multiplier"]),
                       residual_multiplier=float(m["residual_multiplier"]),
                       logits_scaling=float(m["logits_scaling"]))
