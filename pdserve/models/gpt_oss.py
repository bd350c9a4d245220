"""gpt-oss (transformers' GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): Llama's layer with

- attention: q/k/v and o biases (attention_bias), sliding and full layers alternating
  (layer_types; sliding first), YaRN RoPE, and a learned sink logit per head (`self_attn.sinks`)
  that joins every query's softmax denominator (layers/attention.py);
- a mixture of experts in every layer: a router with a bias whose top-k logits are softmaxed
  among themselves, experts with biases and a clamped SwiGLU (swiglu_alpha, swiglu_limit), as
  the checkpoint ships them: stacked `mlp.experts.gate_up_proj` (E, H, 2I) with gate and up
  columns interleaved, `down_proj` (E, I, H), their biases; or, quantized (quant_method mxfp4),
  `gate_up_proj_blocks`/`_scales` and `down_proj_blocks`/`_scales` kept as MXFP4
  (quantization/mxfp4.py). At load the dense experts are transposed and the interleaved rows
  put gate first (the stacked layout of layers/moe.py); MXFP4 rows are reordered the same way,
  their bytes untouched.

Like the other MoE families the CPU backend runs its modules layer by layer (attention kernels
with the sinks, the fused-MoE kernel decoding MXFP4 rows in place)."""
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.layers.attention import PagedAttention
from pdserve.layers.moe import FusedMoE, Router, Routing
from pdserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaVariant, llama_variant
from pdserve.models.llama import refuse, windows_of
from pdserve.models.moe_llama import MoEForCausalLM, num_experts_of


def gate_first(t: torch.Tensor) -> torch.Tensor:
    """Rows (dim 1) interleaved gate, up, gate, up ... -> all gate rows, then all up rows."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()


class GptOssRouter(Router):
    """logits = x W^T + b over the E experts; each token's top k logits, softmaxed among themselves
    in the logits' dtype (transformers' GptOssTopKRouter). A Router, with its own forward, so that
    what counts the routers' choices (pdserve roofline, the step-cost model) finds it."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        nn.Module.__init__(self)
        self.routing = Routing(num_experts=num_experts, top_k=top_k)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(F.linear(x, self.weight, self.bias), self.routing.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype).float(), ids


class GptOssMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, mxfp4: bool):
        super().__init__()
        raw = cfg.raw
        E = num_experts_of(cfg, 128)
        k = raw.get("num_experts_per_tok", 4)
        if not isinstance(k, int) or not 0 < k <= E:
            refuse(cfg, f"num_experts_per_tok must be an integer in 1..{E}, got {k!r}")
        alpha, limit = raw.get("swiglu_alpha", 1.702), raw.get("swiglu_limit", 7.0)
        if not all(isinstance(v, (int, float)) and v > 0 for v in (alpha, limit)):
            refuse(cfg, f"swiglu_alpha and swiglu_limit must be positive numbers, got {alpha!r}, {limit!r}")
        H, I = cfg.hidden_size, cfg.intermediate_size
        if mxfp4 and (H % 32 or I % 32):
            refuse(cfg, f"MXFP4 experts need hidden_size {H} and intermediate_size {I} divisible by 32")
        self.router = GptOssRouter(H, E, k)
        self.experts = FusedMoE(E, H, I, bias=True, swiglu=(float(alpha), float(limit)), mxfp4=mxfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return self.experts(flat, *self.router(flat)).view(x.shape)


class GptOssAttention(LlamaAttention):
    """Llama's attention whose PagedAttention has the sinks."""

    def __init__(self, cfg: ModelConfig, layer: int, variant: LlamaVariant, norm):
        super().__init__(cfg, layer, variant, norm)
        a = self.attn
        self.attn = PagedAttention(a.num_heads, a.num_kv_heads, a.head_dim, a.scale, a.sliding_window, sinks=True)


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, norm, variant: LlamaVariant):
        super().__init__(cfg, layer, norm, variant)
        self.self_attn = GptOssAttention(cfg, layer, variant, norm)
        q = cfg.quantization
        self.mlp = GptOssMLP(cfg, mxfp4=q is not None and q.method == "mxfp4")


class GptOssForCausalLM(MoEForCausalLM):
    layer_class = GptOssDecoderLayer

    @classmethod
    def variant_of(cls, cfg: ModelConfig) -> LlamaVariant:
        raw, L = cfg.raw, cfg.num_layers
        types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
        window = raw.get("sliding_window", 128)
        bias = bool(raw.get("attention_bias", True))
        v = llama_variant(cfg, windows_of(cfg, window, types))
        return replace(v, qkv_bias=bias, o_bias=bias, eps=float(raw.get("rms_norm_eps", 1e-5)))

    def checkpoint_tensors(self) -> dict[str, tuple]:
        """The checkpoint's names and layouts of the sinks and experts (see the module docstring)."""
        out = {}
        for name, m in self.named_modules():
            if isinstance(m, GptOssAttention):
                out[f"{name}.sinks"] = (f"{name}.attn.sinks", None, None)
            elif isinstance(m, FusedMoE):
                if m.mxfp4:
                    for part in ("blocks", "scales"):
                        key = f"{name}.gate_up_proj_{part}"
                        out[key] = (key, None, None, gate_first)
                else:
                    out[f"{name}.gate_up_proj"] = (f"{name}.gate_up_proj", None, None,
                                                   lambda t: gate_first(t.transpose(1, 2)))
                    out[f"{name}.down_proj"] = (f"{name}.down_proj", None, None,
                                                lambda t: t.transpose(1, 2).contiguous())
                out[f"{name}.gate_up_proj_bias"] = (f"{name}.gate_up_proj_bias", None, None, gate_first)
        return out
