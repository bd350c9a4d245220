"""The CPU silu-and-mul and gelu-tanh-and-mul kernels equal torch's silu(gate) * up and
gelu(gate, approximate="tanh") * up (the CPU backend swaps them in: test_packed_linear.py)."""
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


@pytest.mark.parametrize("shape", [(1, 2 * 704), (7, 2 * 33), (300, 2 * 1152)])
def test_gelu_tanh_kernel_equals_torch(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 4
    x[:, 0], x[:, 1], x[:, 2] = 100.0, -100.0, -9.0   # saturated both ways, and where 1 + tanh cancels
    gate, up = x.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    got = cpu_ops().gelu_tanh_and_mul(x)
    assert got.shape == want.shape
    # float64's: torch's fp32 0.5 g (1 + tanh(y)) cancels where the gate is very negative (relative
    # errors of 0.5 there); the kernel's g / (1 + exp(-2y)) does not
    exact = (F.gelu(gate.double(), approximate="tanh") * up.double()).float()
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
