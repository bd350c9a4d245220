"""Gemma 2 and Gemma 3 (text: Gemma3ForCausalLM, model_type gemma3_text).

The Llama decoder with Gemma's differences, all read from config.json as transformers reads them:
  - the embedding is scaled by sqrt(hidden_size), that factor rounded to the model dtype first;
  - RMSNorm weights are offsets from one, norm(x) * (1 + w) in fp32 (layers/layernorm.py: GemmaRMSNorm);
  - four norms a layer: before and after attention, before and after the MLP (the checkpoint's
    post_attention_layernorm is the norm of attention's output, pre_feedforward_layernorm the MLP's input);
  - GeGLU with tanh GELU (hidden_activation gelu_pytorch_tanh);
  - the attention scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
  - local (sliding-window) and global layers interleaved, by layer_types or the pattern;
  - soft caps: Gemma 2's attention scores (attn_logit_softcapping) and the final logits
    (final_logit_softcapping, both families): cap * tanh(x / cap);
  - Gemma 3: q and k normed per head before RoPE, and the local layers' own RoPE base
    (rope_local_base_freq, or rope_parameters["sliding_attention"]); rope scaling is the global layers'.
The embedding is always tied to the lm_head in Gemma checkpoints (tie_word_embeddings defaults to true).

Gemma3ForConditionalGeneration (4B and up: a vision tower beside the text model) is served as this
text model, its vision tower never read (pdserve/vlm_text.py)."""
import os

import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.layers.activation import GeluTanhAndMul
from pdserve.layers.attention import PagedAttention
from pdserve.layers.layernorm import GemmaRMSNorm
from pdserve.layers.merged_linear import MergedLinear
from pdserve.layers.rotary import ROPE_TYPES, Rope, RotaryEmbedding, apply_rotary
from pdserve.models.decoder_spec import DecoderSpec
from pdserve.models.llama import LlamaForCausalLM, LlamaMLP

LAYER_TYPES = ("sliding_attention", "full_attention")


def refuse(cfg: ModelConfig, reason: str):
    raise CheckpointError(f"{os.path.join(cfg.path, 'config.json')}: {reason}")


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, softcap: float | None, qk_norm: bool):
        super().__init__()
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.raw.get("attention_bias", False)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [H * D, Hkv * D, Hkv * D], bias=bias)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=bias)
        # Gemma 3's q/k norms: each head's own RMSNorm before RoPE
        self.q_norm = GemmaRMSNorm(D, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(D, cfg.rms_norm_eps) if qk_norm else None
        scale = cfg.raw.get("query_pre_attn_scalar", 256) ** -0.5
        self.attn = PagedAttention(H, Hkv, D, scale=scale, sliding_window=window, logit_softcap=softcap)
        self.H, self.Hkv, self.D = H, Hkv, D

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
        q, k = q.view(T, self.H, self.D), k.view(T, self.Hkv, self.D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v.view(T, self.Hkv, self.D)))


class GemmaMLP(LlamaMLP):
    """Llama's gated MLP with GeGLU (tanh GELU) for SwiGLU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.act = GeluTanhAndMul()


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, softcap: float | None, qk_norm: bool):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, window, softcap, qk_norm)
        self.mlp = GemmaMLP(cfg)
        self.input_layernorm = GemmaRMSNorm(H, eps)
        self.post_attention_layernorm = GemmaRMSNorm(H, eps)     # of attention's output
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(H, eps)   # of the MLP's output

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None):
        """As LlamaDecoderLayer: x is the previous layer's output, not yet added to the stream."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_types: list[str], ropes: dict, softcap: float | None, qk_norm: bool):
        """ropes: layer type -> (theta, scaling) of its RoPE; one entry: every layer shares it."""
        super().__init__()
        D, P = cfg.head_dim, cfg.max_position_embeddings
        window = cfg.raw.get("sliding_window", 4096)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(D, P, *ropes["full_attention"])
        # Gemma 3's local layers: their own RoPE base (and never the global layers' scaling)
        self.rotary_local = RotaryEmbedding(D, P, *ropes["sliding_attention"]) if len(ropes) > 1 else None
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, window if t == "sliding_attention" else None, softcap,
                                                      qk_norm) for t in layer_types)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.local_rope = [self.rotary_local is not None and t == "sliding_attention" for t in layer_types]
        self.normalizer = cfg.hidden_size ** 0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) as an fp32 tensor cast to the model dtype, as transformers (in bf16 sqrt(3072)
        # is 55.5, not 55.43): the checkpoints were trained with that factor
        return x * torch.tensor(self.normalizer).to(x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        ropes = [self.rotary.lookup(positions, x.dtype)]
        if self.rotary_local is not None:
            ropes.append(self.rotary_local.lookup(positions, x.dtype))
        residual = None
        for layer, local in zip(self.layers, self.local_rope):
            x, residual = layer(ropes[local], x, residual)
        return self.norm(x, residual)[0]


class Gemma2ForCausalLM(nn.Module):
    stacked_params = LlamaForCausalLM.stacked_params
    embed_module = "model.embed_tokens"
    qk_norm = False
    final_softcap_default = 30.0      # transformers' Gemma2Config defaults
    attn_softcap_default = 50.0

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw = cfg.raw
        act = raw.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            refuse(cfg, f"hidden_activation {act!r} is not supported (supported: gelu_pytorch_tanh)")
        if raw.get("use_bidirectional_attention"):
            refuse(cfg, "use_bidirectional_attention: pdserve serves causal decoders only")
        self.final_softcap = raw.get("final_logit_softcapping", self.final_softcap_default)
        self.model = GemmaModel(cfg, self.layer_types(cfg), self.ropes(cfg), self.attn_softcap(cfg), self.qk_norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # --- what differs between Gemma 2 and Gemma 3 -------------------------------------------------
    def layer_types(self, cfg: ModelConfig) -> list[str]:
        """Each layer's attention: config.json's layer_types, else every other layer local from the
        first (transformers' Gemma 2; sliding_window_pattern is Gemma 3's)."""
        return self._layer_types(cfg, pattern=2)

    def ropes(self, cfg: ModelConfig) -> dict:
        return {"full_attention": (cfg.rope_theta, cfg.rope_scaling)}

    def attn_softcap(self, cfg: ModelConfig) -> float | None:
        return cfg.raw.get("attn_logit_softcapping", self.attn_softcap_default)

    @staticmethod
    def _layer_types(cfg: ModelConfig, pattern: int) -> list[str]:
        types = cfg.raw.get("layer_types")
        if types is None:
            return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg.num_layers)]
        if len(types) != cfg.num_layers or not set(types) <= set(LAYER_TYPES):
            refuse(cfg, f"layer_types must be {cfg.num_layers} of {', '.join(LAYER_TYPES)}, got {types!r}")
        return list(types)

    # --- the model -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat batch of T tokens -> hidden states (T, hidden)."""
        return self.model(input_ids, positions)

    def decoder_spec(self) -> DecoderSpec:
        """The layers' recipe (models/decoder_spec.py): norms before and after each block, GeGLU;
        Gemma 3 adds q/k norms and the local layers' RoPE. The attention scale, window and soft cap
        are the PagedAttention's."""
        qk = "self_attn.q_norm" if self.qk_norm else None
        layer_rotary = None
        if self.model.rotary_local is not None:
            layer_rotary = tuple("model.rotary_local" if local else "model.rotary" for local in self.model.local_rope)
        return DecoderSpec(layers="model.layers", attn_norm="input_layernorm", qkv="self_attn.qkv_proj",
                           attention="self_attn.attn", o="self_attn.o_proj", mlp_norm="pre_feedforward_layernorm",
                           up="mlp.gate_up_proj", down="mlp.down_proj", activation="gelu_tanh_and_mul",
                           rotary="model.rotary", final_norm="model.norm", q_norm=qk,
                           k_norm="self_attn.k_norm" if self.qk_norm else None,
                           post_attn_norm="post_attention_layernorm", post_mlp_norm="post_feedforward_layernorm",
                           layer_rotary=layer_rotary)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's input: the scaled embedding."""
        return self.model.embed(input_ids)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            # The CPU backend's fused greedy argmax never calls this: tanh is monotone, so the argmax
            # of the capped logits is the uncapped one's (short of two logits that tanh rounds to
            # the same float, far beyond the cap).
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    final_softcap_default = None      # transformers' Gemma3TextConfig defaults
    attn_softcap_default = None

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        """config.json's layer_types, else one global layer in sliding_window_pattern (default 6)."""
        return self._layer_types(cfg, pattern=cfg.raw.get("sliding_window_pattern", 6))

    def attn_softcap(self, cfg: ModelConfig) -> None:
        return None   # transformers' Gemma 3 attention never applies attn_logit_softcapping

    def ropes(self, cfg: ModelConfig) -> dict:
        """Each layer type's (theta, scaling), as transformers-5 reads either spelling: its own
        rope_parameters per layer type, or transformers-4's rope_theta + rope_scaling (global layers)
        and rope_local_base_freq (local layers, plain RoPE)."""
        raw = cfg.raw
        per_type = raw.get("rope_parameters") or {}
        if not isinstance(per_type, dict) or not all(v is None or isinstance(v, dict) for v in per_type.values()):
            refuse(cfg, "Gemma 3's rope_parameters must be given per layer type (full_attention, sliding_attention)")
        ropes = {}
        for layer_type, theta_key, theta in (("full_attention", "rope_theta", 1e6),
                                            ("sliding_attention", "rope_local_base_freq", 1e4)):
            p = dict(per_type.get(layer_type) or {})
            if layer_type == "full_attention":
                p.update(raw.get("rope_scaling") or {})
            kind = p.pop("type", None)
            kind = p["rope_type"] = p.get("rope_type", kind or "default")
            if kind not in ROPE_TYPES:
                refuse(cfg, f"rope type {kind!r} of the {layer_type} layers is not supported "
                            f"(supported: {', '.join(ROPE_TYPES)})")
            p.setdefault("rope_theta", raw.get(theta_key, theta))
            ropes[layer_type] = (float(p["rope_theta"]), None if kind == "default" else p)
        return ropes
