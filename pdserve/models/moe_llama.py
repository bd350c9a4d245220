"""A Llama whose feed-forward is a mixture of experts (layers/moe.py) in some or all layers: the
common part of Qwen2-MoE, Qwen3-MoE and Mixtral.

Attention, norms and RoPE are Llama's (a LlamaVariant each family reads from its config). Each
decoder layer's MLP is the family's `feed_forward(cfg, layer)`: a SparseMoeBlock, or Llama's dense
MLP where the config keeps the layer dense (`decoder_sparse_step`, `mlp_only_layers`). The
checkpoint keeps one tensor per expert and projection (`...experts.3.gate_proj.weight`); the
model declares where each goes in the stacked parameters (`checkpoint_tensors`, read by the
loader). The CPU decoder stack has no MoE part: the CPU backend runs these models' modules layer
by layer (their linears, norms and attention on its kernels, the experts on its fused-MoE kernel)
and says so in its start-up line."""
from torch import nn

from pdserve.config import ModelConfig
from pdserve.layers.moe import FusedMoE, Routing
from pdserve.models.decoder_spec import DecoderSpec
from pdserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaVariant, refuse


def sparse_layers(cfg: ModelConfig, num_experts: int) -> list[bool]:
    """Which layers have experts, as transformers' Qwen-MoE decides it: every decoder_sparse_step-th
    (layer i with (i + 1) % step == 0) that mlp_only_layers does not list, none without experts."""
    raw, L = cfg.raw, cfg.num_layers
    step = raw.get("decoder_sparse_step", 1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        refuse(cfg, f"decoder_sparse_step must be a positive integer, got {step!r}")
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        refuse(cfg, f"mlp_only_layers must be a list of layer indices, got {only!r}")
    return [num_experts > 0 and i not in only and (i + 1) % step == 0 for i in range(L)]


def routing_of(cfg: ModelConfig, num_experts: int, renormalize: bool) -> Routing:
    """Softmax top-k routing of `num_experts` experts, num_experts_per_tok each."""
    k = cfg.raw.get("num_experts_per_tok")
    if not isinstance(k, int) or not 0 < k <= num_experts:
        refuse(cfg, f"num_experts_per_tok must be an integer in 1..{num_experts}, got {k!r}")
    return Routing(num_experts=num_experts, top_k=k, renormalize=renormalize)


def non_negative_int(cfg: ModelConfig, key: str, default=None) -> int:
    v = cfg.raw.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        refuse(cfg, f"{key} must be a non-negative integer, got {v!r}")
    return v


def num_experts_of(cfg: ModelConfig, default: int, keys=("num_experts", "num_local_experts")) -> int:
    """The expert count under any of its spellings (transformers maps num_experts to
    num_local_experts for Qwen3-MoE and Mixtral, and writes the latter)."""
    given = {cfg.raw[k] for k in keys if k in cfg.raw}
    if len(given) > 1:
        refuse(cfg, f"{' and '.join(keys)} disagree: {sorted(given)}")
    value = given.pop() if given else default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        refuse(cfg, f"{keys[0]} must be a non-negative integer, got {value!r}")
    return value


class MoEDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with the family's feed-forward (its subclass defines `feed_forward`)."""
    def __init__(self, cfg: ModelConfig, layer: int, norm, variant: LlamaVariant | None = None):
        super().__init__(cfg, layer, norm, variant)
        self.mlp = self.feed_forward(cfg, layer)

    @staticmethod
    def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
        """The layer's MLP: a SparseMoeBlock, or LlamaMLP(cfg) where the layer is dense."""
        raise NotImplementedError


class MoEForCausalLM(LlamaForCausalLM):
    # the checkpoint's names of each expert's gate, up and down projections
    expert_names = ("gate_proj", "up_proj", "down_proj")
    # why the CPU decoder stack cannot run these layers (its start-up log line)
    why_no_decoder_spec = "mixture-of-experts MLPs, which the decoder stack's recipe has no part for"

    def checkpoint_tensors(self) -> dict[str, tuple[str, int | None, tuple[int, int] | None]]:
        """Checkpoint tensors that fill part of a parameter (loader.py): name -> (parameter, index
        along its first dim or None, (first row, rows) of that or None)."""
        out = {}
        for name, m in self.named_modules():
            if isinstance(m, FusedMoE):
                out.update(m.checkpoint_tensors(name, self.expert_names))
        return out

    def decoder_spec(self) -> DecoderSpec | None:
        return None

