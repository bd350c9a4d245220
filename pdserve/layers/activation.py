"""Gated activations on the merged gate/up product: SwiGLU's silu(gate) * up, by torch's silu and
mul on the two halves (the CPU backend swaps in one pass of its kernel: backends/cpu/layers.py),
and Gemma's GeGLU, gelu_tanh(gate) * up."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., 2I), gate then up. Returns (..., I)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GeGLU with the tanh approximation of GELU (config hidden_activation gelu_pytorch_tanh, Gemma):
    torch's gelu(approximate="tanh"), the function transformers calls for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., 2I), gate then up. Returns (..., I)."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
