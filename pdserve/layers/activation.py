"""SwiGLU's activation on the merged gate/up product: silu(gate) * up.

On CPU with the compiled kernels (the runner sets use_kernel) one pass of
kernels/activation_cpu.cpp; elsewhere torch's silu and mul on the two halves."""
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.backends.cpu.kernels import cpu_ops


class SiluAndMul(nn.Module):
    use_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., 2I), gate then up. Returns (..., I)."""
        if self.use_kernel and x.dtype == torch.float32:
            y = cpu_ops().silu_and_mul(x.reshape(-1, x.shape[-1]).contiguous())
            return y.view(*x.shape[:-1], y.shape[-1])
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
