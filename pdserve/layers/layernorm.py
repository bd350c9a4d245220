"""RMSNorm, optionally fused with the residual add before it.

Called as norm(x) it returns the normalised x; called as norm(x, residual) it first adds x to the
residual stream and returns (normalised sum, new residual), as vLLM's layers do, so that the add
and the norm are one pass: here torch's add and rms_norm, in the CPU backend its kernel's one
pass in place (backends/cpu/layers.py)."""
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # one op instead of six (bitwise the same result in fp32)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # normalise in fp32 like the reference, whatever the model dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w as an offset from one, the output is norm(x) * (1 + w),
    in fp32 and cast after the weight (transformers' Gemma order; Llama casts before). A backend
    that reads the weight itself uses weight + weight_offset."""
    weight_offset = 1.0

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)   # the identity scale, as transformers initialises it

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight.float() + self.weight_offset
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, scale, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * scale).to(x.dtype)
