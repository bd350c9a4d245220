"""The CPU silu-and-mul kernel equals torch's silu(gate) * up (the CPU backend swaps it in: test_packed_linear.py)."""
import pytest
import torch
import torch.nn.functional as F

from pdserve.backends.cpu.kernels import cpu_ops
from pdserve.backends.cpu.layers import CpuSiluAndMul
from pdserve.layers.activation import SiluAndMul

pytestmark = pytest.mark.usefixtures("cpu_isa")


@pytest.mark.parametrize("shape", [(1, 2 * 704), (7, 2 * 33), (300, 2 * 4864), (2, 3, 2 * 16)])
def test_kernel_equals_torch(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 6   # well into both tails of the sigmoid
    x[..., 0] = 100.0
    x[..., 1] = -100.0
    act = SiluAndMul()
    want = act(x)                # torch
    got = CpuSiluAndMul()(x)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(want, F.silu(gate) * up)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
