"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM: DeepSeek-V3/R1, Kimi K2 and others that reuse it).

Llama's residual stream and RMSNorms around two other parts:
- multi-head latent attention (layers/mla.py): q through a low-rank latent (q_lora_rank; None: a
  plain q_proj), K/V through the kv_lora_rank latent that the paged cache keeps with the rope key
  (kv_spec: kv_lora_rank + qk_rope_head_dim values per token and layer), RoPE on qk_rope_head_dim
  dims in the interleaved layout (rope_interleave), yarn's mscale_all_dim folded into the softmax
  scale as transformers does;
- the first first_k_dense_replace layers a dense SwiGLU MLP, the others routed experts
  (layers/moe.py: sigmoid scores of an fp32 router, e_score_correction_bias for choosing only,
  the best topk_group of n_group groups, renormalised where norm_topk_prob says, times
  routed_scaling_factor) plus n_shared_experts shared experts as one MLP every token goes through.
The multi-token-prediction layers some checkpoints ship after the last layer (num_nextn_predict_layers)
are not used to generate, as in transformers: their tensors are skipped."""
from torch import nn

from pdserve.config import ModelConfig
from pdserve.engine.kv_spec import KVSpec
from pdserve.layers.mla import MLAShape, MultiHeadLatentAttention
from pdserve.layers.moe import Routing, SparseMoeBlock
from pdserve.layers.rotary import yarn_mscale
from pdserve.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaVariant, refuse, swiglu_variant
from pdserve.models.moe_llama import MoEForCausalLM, non_negative_int, num_experts_of


def mla_shape(cfg: ModelConfig) -> MLAShape:
    raw = cfg.raw
    q_rank = raw.get("q_lora_rank", 1536)
    if q_rank is not None and (not isinstance(q_rank, int) or q_rank < 1):
        refuse(cfg, f"q_lora_rank must be a positive integer or null, got {q_rank!r}")
    sizes = {k: raw.get(k, d) for k, d in (("kv_lora_rank", 512), ("qk_nope_head_dim", 128),
                                           ("qk_rope_head_dim", 64), ("v_head_dim", 128))}
    for k, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or (k == "qk_rope_head_dim" and v % 2):
            refuse(cfg, f"{k} must be a positive{' even' if k == 'qk_rope_head_dim' else ''} integer, got {v!r}")
    return MLAShape(cfg.num_heads, q_rank, **sizes)


def softmax_scale(cfg: ModelConfig, s: MLAShape) -> float:
    """transformers' yarn_apply_mscale: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim)
    squared where a scaled rope gives mscale_all_dim."""
    scale = s.qk_head_dim ** -0.5
    p = cfg.rope_parameters()
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        m = yarn_mscale(p["factor"], p["mscale_all_dim"])
        scale = scale * m * m   # in transformers' order: the same float
    return scale


class DeepseekV3MoE(SparseMoeBlock):
    """Routed experts plus the shared ones (the checkpoint's `shared_experts`), ungated."""

    def __init__(self, cfg: ModelConfig):
        raw = cfg.raw
        E = num_experts_of(cfg, 256, keys=("n_routed_experts",))
        k = raw.get("num_experts_per_tok", 8)
        groups, top_groups = raw.get("n_group") or 1, raw.get("topk_group") or 1
        if not isinstance(k, int) or not 0 < k <= E:
            refuse(cfg, f"num_experts_per_tok must be an integer in 1..{E}, got {k!r}")
        if not isinstance(groups, int) or E % groups or not isinstance(top_groups, int) or not 0 < top_groups <= groups:
            refuse(cfg, f"n_group {groups!r} must divide n_routed_experts {E}, topk_group {top_groups!r} be in 1..n_group")
        if groups > 1 and E // groups < 2:   # transformers ranks a group by its two best scores
            refuse(cfg, f"n_group {groups} leaves fewer than 2 experts per group")
        if k > top_groups * (E // groups):
            refuse(cfg, f"num_experts_per_tok {k} exceeds the experts of topk_group {top_groups} groups")
        scaling = raw.get("routed_scaling_factor", 2.5)
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
            refuse(cfg, f"routed_scaling_factor must be a number, got {scaling!r}")
        routing = Routing(num_experts=E, top_k=k, scoring="sigmoid", renormalize=bool(raw.get("norm_topk_prob", True)),
                          n_group=groups, topk_group=top_groups, routed_scaling_factor=float(scaling),
                          score_bias=True, fp32_logits=True)
        moe_size = non_negative_int(cfg, "moe_intermediate_size", 2048)
        shared = non_negative_int(cfg, "n_shared_experts", 1)
        if shared < 1 or moe_size < 1:
            refuse(cfg, "n_shared_experts and moe_intermediate_size must be at least 1")
        super().__init__(cfg.hidden_size, routing, moe_size, shared_expert=LlamaMLP(cfg, moe_size * shared))
        self.shared_experts = self._modules.pop("shared_expert")

    @property
    def shared_expert(self) -> nn.Module:   # what SparseMoeBlock.forward calls
        return self.shared_experts


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its forward: the pre-norms and residual adds) with MLA and the dense or MoE MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, norm, variant: LlamaVariant):
        nn.Module.__init__(self)
        s = mla_shape(cfg)
        raw = cfg.raw
        self.self_attn = MultiHeadLatentAttention(cfg.hidden_size, s, softmax_scale(cfg, s),
                                                  bias=bool(raw.get("attention_bias", False)),
                                                  interleaved=bool(raw.get("rope_interleave", True)), norm=norm)
        dense = non_negative_int(cfg, "first_k_dense_replace", 3)
        self.mlp = LlamaMLP(cfg) if layer < dense else DeepseekV3MoE(cfg)
        self.input_layernorm = norm(cfg.hidden_size, variant.eps)
        self.post_attention_layernorm = norm(cfg.hidden_size, variant.eps)
        self.residual_multiplier = 1.0


class DeepseekV3ForCausalLM(MoEForCausalLM):
    layer_class = DeepseekV3DecoderLayer
    # only the MLPs' gate and up are merged: q_proj (q_lora_rank null) is MLA's own
    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    why_no_decoder_spec = ("multi-head latent attention and mixture-of-experts MLPs, which the decoder stack's "
                           "recipe has no part for")

    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        return swiglu_variant(cfg, (None,) * cfg.num_layers)   # no sliding windows

    @staticmethod
    def kv_spec(cfg: ModelConfig) -> KVSpec:
        """One latent row per token and layer (engine/kv_spec.py), not K and V per head."""
        return KVSpec(planes=1, heads=1, dim=mla_shape(cfg).latent_dim)

    def skips_tensor(self, name: str) -> bool:
        """The multi-token-prediction layers' tensors (model.layers.<num_hidden_layers>... on)."""
        parts = name.split(".")
        return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and int(parts[2]) >= len(self.model.layers))
