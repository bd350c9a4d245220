"""The Llama family: Llama, Qwen2 (q/k/v bias, sliding-window layers from max_window_layers on),
Mistral (sliding window).

RMSNorm, RoPE, SwiGLU, grouped-query attention. Module names mirror the HF checkpoints so that
loading is a name match, except q/k/v and gate/up: each is one MergedLinear, filled shard by shard
(`stacked_params`). A Llama-like family is a subclass (another `norm_class`, its
`variant_of(cfg)`: how its layers differ from Llama's, read from its config.json)
and one entry in models/__init__.py (its config.json's sizes: pdserve/config_fields.py): decoder_spec() tells the backends what its layers compute.
Qwen3, OLMo 2, Granite, SmolLM3 and Ministral are such subclasses, each in its own file."""
import os
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.errors import CheckpointError
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.attention import PagedAttention
from pdserve.layers.layernorm import RMSNorm
from pdserve.layers.merged_linear import MergedLinear
from pdserve.layers.rotary import Rope, RotaryEmbedding, apply_rotary
from pdserve.models.decoder_spec import DecoderSpec


@dataclass(frozen=True)
class LlamaVariant:
    """How a Llama-like family's layers differ from Llama's, read from its config.json by the
    family's variant_of(cfg). Each default is Llama's."""
    windows: tuple[int | None, ...]     # each layer's sliding window (None: full attention)
    qkv_bias: bool = False
    o_bias: bool = False
    eps: float = 1e-6                   # of every RMSNorm
    rope_layers: tuple[bool, ...] | None = None   # the layers that rotate q and k (None: all; SmolLM3 has NoPE layers)
    qk_norm: str | None = None          # an RMSNorm of q and k before RoPE: "head" over each head (Qwen3),
                                        # "proj" over the whole projection (OLMo 2)
    attention_scale: float | None = None   # None: head_dim ** -0.5 (Granite: attention_multiplier)
    residual_multiplier: float = 1.0    # each block's output is scaled by it as it joins the stream (Granite)
    embedding_multiplier: float = 1.0   # the embeddings are scaled by it (Granite)
    logits_scaling: float = 1.0         # the logits are divided by it (Granite)
    # Ministral 3 (Llama 4's long-context trick): after RoPE, q is scaled by
    # 1 + beta * log(1 + floor(position / period)); None: not
    query_scale: tuple[float, int] | None = None


def llama_variant(cfg: ModelConfig, windows: tuple[int | None, ...] | None = None) -> LlamaVariant:
    """Llama's, Qwen2's (q/k/v bias, no o bias) and Mistral's; the windows as config.py reads them
    unless given (a family's own rule)."""
    qwen2 = cfg.architecture == "Qwen2ForCausalLM"
    bias = bool(cfg.raw.get("attention_bias", False))
    return LlamaVariant(windows=tuple(cfg.layer_windows if windows is None else windows), qkv_bias=qwen2 or bias,
                        o_bias=not qwen2 and bias, eps=cfg.rms_norm_eps)


def swiglu_variant(cfg: ModelConfig, windows: tuple[int | None, ...]) -> LlamaVariant:
    """llama_variant with the family's windows, for a family whose transformers MLP gates by
    config.json's hidden_act: one other than silu is refused (the MLP here is SwiGLU)."""
    if (act := cfg.raw.get("hidden_act", "silu")) != "silu":
        refuse(cfg, f"hidden_act {act!r} is not supported (supported: silu)")
    return llama_variant(cfg, windows)


def refuse(cfg: ModelConfig, reason: str):
    """A config.json pdserve cannot serve exactly: one line naming the file and the reason."""
    raise CheckpointError(f"{os.path.join(cfg.path, 'config.json')}: {cfg.architecture}: {reason}")


def windows_of(cfg: ModelConfig, window: int | None, layer_types: list[str]) -> tuple[int | None, ...]:
    """Each layer's window: `window` on the "sliding_attention" layers (None: full attention
    everywhere), as transformers masks them."""
    if len(layer_types) != cfg.num_layers:
        refuse(cfg, f"layer_types has {len(layer_types)} entries for {cfg.num_layers} layers")
    if unknown := set(layer_types) - {"full_attention", "sliding_attention"}:
        refuse(cfg, f"layer types {sorted(unknown)} are not supported (supported: full_attention, sliding_attention)")
    if window is not None and (not isinstance(window, int) or window < 1):
        refuse(cfg, f"sliding_window must be a positive integer, got {window!r}")
    return tuple(window if window is not None and t == "sliding_attention" else None for t in layer_types)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, variant: LlamaVariant | None = None, norm=RMSNorm):
        super().__init__()
        v = variant or llama_variant(cfg)
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [H * D, Hkv * D, Hkv * D], bias=v.qkv_bias)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=v.o_bias)
        self.qk_norm = v.qk_norm
        if v.qk_norm is not None:   # weights of head_dim entries (per head) or of the whole projection
            self.q_norm = norm(D if v.qk_norm == "head" else H * D, v.eps)
            self.k_norm = norm(D if v.qk_norm == "head" else Hkv * D, v.eps)
        self.use_rope = v.rope_layers is None or bool(v.rope_layers[layer])
        scale = D ** -0.5 if v.attention_scale is None else v.attention_scale
        self.attn = PagedAttention(H, Hkv, D, scale=scale, sliding_window=v.windows[layer])
        self.H, self.Hkv, self.D = H, Hkv, D

    def forward(self, rope: Rope, x: torch.Tensor, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q_scale: (T, 1, 1), each token's query scale (Ministral 3), None: none."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(T, self.H, self.D), k.view(T, self.Hkv, self.D), v.view(T, self.Hkv, self.D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rotary(rope, q, k)
        if q_scale is not None:
            q = q * q_scale
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        """intermediate_size: the config's unless given (an MoE model's shared expert)."""
        super().__init__()
        bias = cfg.raw.get("mlp_bias", False)
        size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [size] * 2, bias=bias)
        self.act = SiluAndMul()
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    # the recipe's norms of this layer (models/decoder_spec.py): one before each block
    norms = dict(attn_norm="input_layernorm", mlp_norm="post_attention_layernorm")

    def __init__(self, cfg: ModelConfig, layer: int, norm=RMSNorm, variant: LlamaVariant | None = None):
        super().__init__()
        v = variant or llama_variant(cfg)
        self.self_attn = LlamaAttention(cfg, layer, v, norm)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = norm(cfg.hidden_size, v.eps)
        self.post_attention_layernorm = norm(cfg.hidden_size, v.eps)
        self.residual_multiplier = v.residual_multiplier

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, q_scale: torch.Tensor | None = None):
        """x: the previous layer's output, not yet added to the residual stream (None before the
        first layer: x is the embedding). Returns this layer's output and the stream."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, x, q_scale)
        r = self.residual_multiplier
        x, residual = self.post_attention_layernorm(h if r == 1.0 else h * r, residual)
        h = self.mlp(x)
        return h if r == 1.0 else h * r, residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, norm=RMSNorm, variant: LlamaVariant | None = None,
                 layer_class=LlamaDecoderLayer):
        super().__init__()
        v = variant or llama_variant(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_class(cfg, i, norm, v) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, v.eps)
        self.embedding_multiplier, self.query_scale = v.embedding_multiplier, v.query_scale

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)   # once per forward, shared by every layer
        extra = {}
        if self.query_scale is not None:   # each token's, once per forward too
            beta, period = self.query_scale
            scale = 1 + beta * torch.log(1 + torch.floor(positions / period))
            extra["q_scale"] = scale.to(x.dtype)[:, None, None]
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, **extra)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint module -> (our merged module, shard): HF checkpoints keep q/k/v and gate/up apart
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    embed_module = "model.embed_tokens"
    # a norm(dim, eps) called as norm(x) or norm(x, residual) -> (norm of x + residual, x + residual)
    norm_class = RMSNorm
    layer_class = LlamaDecoderLayer

    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        """How this family's layers differ from Llama's (a config it cannot serve exactly: CheckpointError)."""
        return llama_variant(cfg)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.variant = v = self.variant_of(cfg)
        self.model = LlamaModel(cfg, self.norm_class, v, self.layer_class)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat batch of T tokens -> hidden states (T, hidden)."""
        return self.model(input_ids, positions)

    def decoder_spec(self) -> DecoderSpec | None:
        """The layers' recipe (models/decoder_spec.py): pre-norm, RoPE, SwiGLU, the final norm, and
        the variant's parts. None where the recipe has no part for one (Ministral 3's query scale):
        the modules run the layers then."""
        v = self.variant
        if v.query_scale is not None:
            return None
        qk = dict(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm") if v.qk_norm else {}
        rotary = None if v.rope_layers is None else tuple("model.rotary" if r else None for r in v.rope_layers)
        return DecoderSpec(layers="model.layers", qkv="self_attn.qkv_proj", attention="self_attn.attn",
                           o="self_attn.o_proj", up="mlp.gate_up_proj", down="mlp.down_proj",
                           activation="silu_and_mul", rotary="model.rotary", final_norm="model.norm",
                           residual_multiplier=v.residual_multiplier, layer_rotary=rotary,
                           **self.layer_class.norms, **qk)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's input (for a backend that runs the layers itself)."""
        return self.model.embed(input_ids)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states from the layers' output (the final norm is in the recipe)."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        # Granite's scaling. The CPU backend's fused greedy argmax takes lm_head's argmax without
        # this: dividing by a positive scale (variant_of refuses others) keeps the argmax.
        s = self.variant.logits_scaling
        return logits if s == 1.0 else logits / s
