"""What a model's decoder layers compute, declared once beside its modules.

A backend that runs the layers as one loop of its own (the CPU backend's decoder stack,
backends/cpu/stack.py) reads this recipe and collects each layer's tensors from the modules it
names; the norm kind (RMSNorm or LayerNorm) and every size come from those modules. The model
declares it as decoder_spec(), beside embed(input_ids, positions) (the first layer's input) and
finish(hidden) (what follows the recipe's layers: its forward is finish(layers(embed(...)))). A
model that declares none, or one the backend cannot run, runs its torch modules layer by layer."""
from dataclasses import dataclass



@dataclass(frozen=True)
class DecoderSpec:
    layers: str                   # the nn.ModuleList of decoder layers, from the model's root
    # in each layer, by module name:
    attn_norm: str                # the norm before attention (pre-norm) or after its residual add (post-norm)
    qkv: str                      # one linear of q, k then v rows
    attention: str                # the PagedAttention: heads, head size, scale and the cache views
    o: str                        # attention's output projection
    mlp_norm: str
    up: str                       # gate then up rows (activation silu_and_mul), or the MLP's first linear
    down: str
    activation: str               # of up's output: "silu_and_mul" (gated), "relu", "gelu", "silu", ...
    norm_position: str = "pre"    # "pre": a norm before each block; "post": after each residual add
    rotary: str | None = None     # the RotaryEmbedding (rotate-half) of q and k, from the root; None: no RoPE
    final_norm: str | None = None  # pre-norm only: the norm of the stream after the last layer, from the root

    def __post_init__(self):
        if self.norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be pre or post, got {self.norm_position!r}")
