"""The Llama family: Llama, Qwen2 (q/k/v bias, sliding-window layers from max_window_layers on),
Mistral (sliding window).

RMSNorm, RoPE, SwiGLU, grouped-query attention. Module names mirror the HF checkpoints so that
loading is a name match, except q/k/v and gate/up: each is one MergedLinear, filled shard by shard
(`stacked_params`). A Llama-like family is a subclass here (another `norm_class`, its own
config_fields) and one entry in models/__init__.py: decoder_spec() tells the backends what its
layers compute."""
import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.attention import PagedAttention
from pdserve.layers.layernorm import RMSNorm
from pdserve.layers.merged_linear import MergedLinear
from pdserve.layers.rotary import Rope, RotaryEmbedding, apply_rotary
from pdserve.models.decoder_spec import DecoderSpec


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_bias = cfg.architecture == "Qwen2ForCausalLM" or cfg.raw.get("attention_bias", False)
        o_bias = cfg.architecture != "Qwen2ForCausalLM" and cfg.raw.get("attention_bias", False)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [H * D, Hkv * D, Hkv * D], bias=qkv_bias)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=o_bias)
        self.attn = PagedAttention(H, Hkv, D, scale=D ** -0.5, sliding_window=cfg.layer_windows[layer])
        self.H, self.Hkv, self.D = H, Hkv, D

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
        q, k = apply_rotary(rope, q.view(T, self.H, self.D), k.view(T, self.Hkv, self.D))
        v = v.view(T, self.Hkv, self.D)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias = cfg.raw.get("mlp_bias", False)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias)
        self.act = SiluAndMul()
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, norm=RMSNorm):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None):
        """x: the previous layer's output, not yet added to the residual stream (None before the
        first layer: x is the embedding). Returns this layer's output and the stream."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(rope, x), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, norm=RMSNorm):
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, norm) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)   # once per forward, shared by every layer
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint module -> (our merged module, shard): HF checkpoints keep q/k/v and gate/up apart
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    embed_module = "model.embed_tokens"
    # a norm(dim, eps) called as norm(x) or norm(x, residual) -> (norm of x + residual, x + residual)
    norm_class = RMSNorm

    @staticmethod
    def config_fields(raw: dict) -> dict:
        """ModelConfig's sizes from this family's config.json (a missing required key raises KeyError)."""
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        return dict(vocab_size=raw["vocab_size"], hidden_size=hidden, num_layers=raw["num_hidden_layers"],
                    num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
                    head_dim=raw.get("head_dim") or hidden // heads, intermediate_size=raw["intermediate_size"],
                    max_position_embeddings=raw.get("max_position_embeddings", 2048),
                    tie_word_embeddings=raw.get("tie_word_embeddings", False))

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.model = LlamaModel(cfg, self.norm_class)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat batch of T tokens -> hidden states (T, hidden)."""
        return self.model(input_ids, positions)

    def decoder_spec(self) -> DecoderSpec:
        """The layers' recipe (models/decoder_spec.py): pre-norm, RoPE, SwiGLU, the final norm."""
        return DecoderSpec(layers="model.layers", attn_norm="input_layernorm", qkv="self_attn.qkv_proj",
                           attention="self_attn.attn", o="self_attn.o_proj", mlp_norm="post_attention_layernorm",
                           up="mlp.gate_up_proj", down="mlp.down_proj", activation="silu_and_mul",
                           rotary="model.rotary", final_norm="model.norm")

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's input (for a backend that runs the layers itself)."""
        return self.model.embed_tokens(input_ids)

    def finish(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states from the layers' output (the final norm is in the recipe)."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
