"""Mixture-of-experts: the router and the experts, shared by the MoE families (Qwen2-MoE, Qwen3-MoE,
Mixtral; DeepSeek's grouped, biased sigmoid routing has its switches here too).

The router scores each token against every expert (a linear of E outputs, then softmax or sigmoid)
and keeps the top k (within the best `topk_group` of `n_group` groups where the config groups
them), renormalised or not, times a routed scaling factor. The experts are stored stacked, one
parameter per kind for all E experts: gate_up (E, 2I, H), gate rows then up rows, and down
(E, H, I); the loader fills each expert's slice from the checkpoint's per-expert tensors
(`expert_tensors`). A step's (token, expert) pairs are sorted by expert, so each selected
expert's weights are read once for all the tokens routed to it (vLLM's FusedMoE, llama.cpp's
mul_mat_id); the weighted outputs are added back to their tokens. This torch forward is the
reference the CPU kernel is tested against.

gpt-oss's experts add a bias to both products and a clamped SwiGLU (`swiglu` = (alpha, limit)),
and ship as MXFP4 (quantization/mxfp4.py): then the stacked parameters are the checkpoint's blocks
and scales (`gate_up_proj_blocks`, `..._scales`, ...), and an expert's rows are decoded only when a
step selects it."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.activation import SiluAndMul
from pdserve.quantization.mxfp4 import BLOCK as MXFP4_BLOCK, dequantize as mxfp4_dequantize


@dataclass(frozen=True)
class Routing:
    """How the router turns its logits into each token's experts and weights (read from the
    family's config.json)."""
    num_experts: int
    top_k: int
    scoring: str = "softmax"        # "softmax" over all experts, or "sigmoid" of each (DeepSeek-V3)
    renormalize: bool = True        # the k weights divided by their sum (norm_topk_prob; Mixtral always)
    n_group: int = 1                # experts in n_group groups; a token picks from the best topk_group groups,
    topk_group: int = 1             # a group ranked by the sum of its two best scores (DeepSeek-V3)
    routed_scaling_factor: float = 1.0   # the k weights times this, after renormalising
    score_bias: bool = False        # a per-expert bias added to the scores for choosing only
                                    # (e_score_correction_bias), the weights stay the unbiased scores
    fp32_logits: bool = False       # the router's product in fp32 whatever the model's dtype (DeepSeek-V3)

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be softmax or sigmoid, got {self.scoring!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide num_experts {self.num_experts}, "
                             f"topk_group {self.topk_group} be in 1..n_group")


def select_experts(logits: torch.Tensor, r: Routing, bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) fp32, expert ids (T, k)), in transformers' order of
    operations: scores in fp32, top k by score (ties: torch.topk's), renormalised, scaled."""
    scores = logits.float().softmax(-1) if r.scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if r.n_group > 1:   # keep the experts of the best topk_group groups, each ranked by its two best
        T = choice.shape[0]
        groups = choice.view(T, r.n_group, -1)
        best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(best).scatter_(1, best.topk(r.topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
    if bias is None:
        weights, ids = choice.topk(r.top_k, dim=-1)
    else:
        ids = choice.topk(r.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if r.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if r.scoring == "sigmoid" else 0.0))
    if r.routed_scaling_factor != 1.0:
        weights = weights * r.routed_scaling_factor
    return weights, ids


class Router(nn.Module):
    """The gate: logits = x W^T over the E experts (kept in the model's dtype, as transformers'),
    then select_experts. Not an nn.Linear, so the CPU backend keeps it on torch's product: the
    experts a token picks are then those transformers picks from the same hidden state."""

    def __init__(self, hidden_size: int, routing: Routing):
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden_size))
        if routing.score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(routing.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = self.e_score_correction_bias if self.routing.score_bias else None
        logits = F.linear(x.float(), self.weight.float()) if self.routing.fp32_logits else F.linear(x, self.weight)
        return select_experts(logits, self.routing, bias)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of (n, 2I) gate then up columns: the gate clamped above at limit, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate), in transformers' order."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class FusedMoE(nn.Module):
    """E SwiGLU experts, stacked: gate_up_proj (E, 2I, H), down_proj (E, H, I); with bias,
    gate_up_proj_bias (E, 2I) and down_proj_bias (E, H); swiglu (alpha, limit): gpt-oss's clamped
    SwiGLU (None: silu(gate) * up); mxfp4: the weights as MXFP4 blocks and scales instead,
    gate_up_proj_blocks (E, 2I, H / 32, 16), down_proj_blocks (E, H, I / 32, 16) and their scales."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 swiglu: tuple[float, float] | None = None, mxfp4: bool = False):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        E, H, I = num_experts, hidden_size, intermediate_size
        self.mxfp4, self.swiglu = mxfp4, swiglu
        if mxfp4:
            if H % MXFP4_BLOCK or I % MXFP4_BLOCK:
                raise ValueError(f"MXFP4 experts need hidden {H} and intermediate {I} sizes divisible by {MXFP4_BLOCK}")
            for name, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
                n = cols // MXFP4_BLOCK
                self.register_parameter(f"{name}_blocks", nn.Parameter(
                    torch.empty(E, rows, n, 16, dtype=torch.uint8), requires_grad=False))
                self.register_parameter(f"{name}_scales", nn.Parameter(
                    torch.empty(E, rows, n, dtype=torch.uint8), requires_grad=False))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
            self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(E, H)) if bias else None
        self.act = SiluAndMul()

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's gate_up (2I, H) and down (H, I) weights (MXFP4: decoded to dtype)."""
        if not self.mxfp4:
            return self.gate_up_proj[e], self.down_proj[e]
        return (mxfp4_dequantize(self.gate_up_proj_blocks[e], self.gate_up_proj_scales[e], dtype),
                mxfp4_dequantize(self.down_proj_blocks[e], self.down_proj_scales[e], dtype))

    def checkpoint_tensors(self, prefix: str, names: tuple[str, str, str]) -> dict[str, tuple[str, int, tuple | None]]:
        """The per-expert checkpoint tensors this layer's stacked parameters hold: name ->
        (our parameter, expert, (first row, rows) of it or None: all). `names` are the
        checkpoint's gate, up and down modules (Qwen: gate_proj, up_proj, down_proj; Mixtral: w1,
        w3, w2); `prefix` is this module's name."""
        gate, up, down = names
        I = self.intermediate_size
        out = {}
        for e in range(self.num_experts):
            out[f"{prefix}.{e}.{gate}.weight"] = (f"{prefix}.gate_up_proj", e, (0, I))
            out[f"{prefix}.{e}.{up}.weight"] = (f"{prefix}.gate_up_proj", e, (I, I))
            out[f"{prefix}.{e}.{down}.weight"] = (f"{prefix}.down_proj", e, None)
        return out

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, H); weights, ids (T, k): each token's experts and their weights. Returns (T, H):
        sum over its k experts of weight x down(silu(gate) * up)."""
        T, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)            # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        xs = x[tokens]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:   # expert e's weights, once for its n rows
                rows = slice(start, start + n)
                w13, w2 = self.expert(e, x.dtype)
                h = F.linear(xs[rows], w13)
                if self.gate_up_proj_bias is not None:   # added after the product, as transformers adds it
                    h = h + self.gate_up_proj_bias[e]
                h = self.act(h) if self.swiglu is None else clamped_swiglu(h, *self.swiglu)
                y = F.linear(h, w2)
                ys[rows] = y if self.down_proj_bias is None else y + self.down_proj_bias[e]
                start += n
        ys = (ys.float() * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, ys)

    def held_weights(self) -> list[torch.Tensor]:
        """The stacked experts' tensors in the form this layer holds them (dense; MXFP4 blocks and
        scales; a CPU subclass's int8 codes and scales), not the biases: what a step streams."""
        return [t for n, t in [*self.named_parameters(recurse=False), *self.named_buffers(recurse=False)]
                if n.startswith(("gate_up_proj", "down_proj")) and not n.endswith("_bias")]

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"
                + (", mxfp4" if self.mxfp4 else ""))


class SparseMoeBlock(nn.Module):
    """A layer's feed-forward as a mixture of experts: the router (`gate`), the routed experts
    (`experts`), and optionally a shared expert every token goes through (`shared_expert`), scaled
    by sigmoid(shared_expert_gate(x)) where the family gates it (Qwen2-MoE)."""

    def __init__(self, hidden_size: int, routing: Routing, intermediate_size: int,
                 shared_expert: nn.Module | None = None, shared_expert_gate: bool = False):
        super().__init__()
        self.gate = Router(hidden_size, routing)
        self.experts = FusedMoE(routing.num_experts, hidden_size, intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.experts(flat, *self.gate(flat))
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(x.shape)
