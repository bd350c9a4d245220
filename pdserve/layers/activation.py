"""SwiGLU's activation on the merged gate/up product: silu(gate) * up, by torch's silu and mul on
the two halves (the CPU backend swaps in one pass of its kernel: backends/cpu/layers.py)."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., 2I), gate then up. Returns (..., I)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
