"""What a model's decoder layers compute, declared once beside its modules.

A backend that runs the layers as one loop of its own (the CPU backend's decoder stack,
backends/cpu/stack.py) reads this recipe and collects each layer's tensors from the modules it
names; the norm kind (RMSNorm or LayerNorm) and every size come from those modules. The model
declares it as decoder_spec(), beside embed(input_ids, positions) (the first layer's input) and
finish(hidden) (what follows the recipe's layers: its forward is finish(layers(embed(...)))). A
model that declares none, or one the backend cannot run, runs its torch modules layer by layer.

A pre-norm layer of the recipe, every optional part shown (r = residual_multiplier):
    h = attn_norm(x); q, k, v = qkv(h); q, k = q_norm(q), k_norm(k); q, k = rope(q, k)
    x = x + r * post_attn_norm(o(attention(q, k, v)))
    x = x + r * post_mlp_norm(down(act(up(mlp_norm(x)))))"""
from dataclasses import dataclass



@dataclass(frozen=True)
class DecoderSpec:
    layers: str                   # the nn.ModuleList of decoder layers, from the model's root
    # in each layer, by module name:
    attn_norm: str | None         # the norm before attention (pre-norm; None: none, OLMo 2) or after its residual add (post-norm)
    qkv: str                      # one linear of q, k then v rows
    attention: str                # the PagedAttention: heads, head size, scale, sliding window, soft cap, the cache views
    o: str                        # attention's output projection
    mlp_norm: str | None
    up: str                       # gate then up rows (activation *_and_mul), or the MLP's first linear
    down: str
    activation: str               # of up's output: "silu_and_mul" (gated), "gelu_tanh_and_mul" (Gemma's GeGLU),
                                  # "relu", "gelu", "silu", ...
    norm_position: str = "pre"    # "pre": a norm before each block; "post": after each residual add
    rotary: str | None = None     # the RotaryEmbedding (rotate-half) of q and k, from the root; None: no RoPE
    final_norm: str | None = None  # pre-norm only: the norm of the stream after the last layer, from the root
    # pre-norm only, each optional (None: none):
    q_norm: str | None = None     # the norm of q before RoPE: over each head (its weight has head_dim entries,
    k_norm: str | None = None     # Qwen3, Gemma 3) or over the whole projection (H x head_dim entries, OLMo 2)
    post_attn_norm: str | None = None  # the norm of attention's output before it joins the stream (Gemma, OLMo 2)
    post_mlp_norm: str | None = None   # the norm of the MLP's output before it joins the stream
    residual_multiplier: float = 1.0   # each block's output is scaled by this as it joins the stream (Granite)
    # each layer's RotaryEmbedding from the root, None where a layer has no RoPE (SmolLM3) or another
    # base (Gemma 3's local layers); None: `rotary` in every layer
    layer_rotary: tuple[str | None, ...] | None = None

    def __post_init__(self):
        if self.norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be pre or post, got {self.norm_position!r}")
        extras = (self.q_norm, self.k_norm, self.post_attn_norm, self.post_mlp_norm)
        if self.norm_position == "post" and (any(extras) or self.residual_multiplier != 1.0):
            raise ValueError("q/k norms, post-block norms and a residual multiplier are for pre-norm stacks")

    def rotary_of(self, layer: int) -> str | None:
        """The RotaryEmbedding of layer `layer` (from the root), None: no RoPE there."""
        return self.rotary if self.layer_rotary is None else self.layer_rotary[layer]
