"""The CPU RMSNorm kernels equal torch's add + rms_norm (the CPU backend swaps them in: test_packed_linear.py)."""
import pytest
import torch
import torch.nn.functional as F

from pdserve.backends.cpu.kernels import cpu_ops
from pdserve.backends.cpu.layers import CpuRMSNorm
from pdserve.layers.layernorm import RMSNorm

pytestmark = pytest.mark.usefixtures("cpu_isa")


def norms(n: int) -> tuple[RMSNorm, RMSNorm]:
    torch.manual_seed(1)
    torch_norm = RMSNorm(n, 1e-5)
    with torch.no_grad():
        torch_norm.weight.copy_(torch.randn(n))
    kernel_norm = CpuRMSNorm(n, 1e-5)
    kernel_norm.load_state_dict(torch_norm.state_dict())
    return torch_norm, kernel_norm


@pytest.mark.parametrize("rows,n", [(1, 896), (32, 896), (5, 100), (600, 256), (3, 8)])
def test_norm_equals_torch(rows, n):
    torch_norm, kernel_norm = norms(n)
    x = torch.randn(rows, n) * 3
    want = torch_norm(x)
    torch.testing.assert_close(want, F.rms_norm(x, (n,), torch_norm.weight, 1e-5))
    torch.testing.assert_close(kernel_norm(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,n", [(1, 896), (32, 896), (5, 100), (600, 256)])
def test_fused_add_equals_add_then_norm(rows, n):
    torch_norm, kernel_norm = norms(n)
    x, residual = torch.randn(rows, n), torch.randn(rows, n) * 4
    want_x, want_residual = torch_norm(x.clone(), residual.clone())
    torch.testing.assert_close(want_residual, x + residual)
    torch.testing.assert_close(want_x, F.rms_norm(x + residual, (n,), torch_norm.weight, 1e-5))
    kr = residual.clone()
    got_x, got_residual = kernel_norm(x.clone(), kr)
    assert got_residual is kr   # the residual stream is updated in place
    torch.testing.assert_close(got_residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)


def test_strided_input_is_copied_not_misread():
    torch_norm, kernel_norm = norms(64)
    x = torch.randn(64, 7).t()   # (7, 64), not contiguous
    torch.testing.assert_close(kernel_norm(x), torch_norm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,H,Hkv,n", [(1, 14, 2, 64), (37, 8, 4, 16), (300, 4, 1, 256)])
@pytest.mark.parametrize("whole", [False, True])
def test_heads_in_place_on_qkv_views(T, H, Hkv, n, whole):
    """q/k norms (Qwen3, Gemma 3: each head; OLMo 2: the whole projection) in place on the views of
    the qkv product: the bits of the kernel on a contiguous copy (what the modules run) and close to torch."""
    torch.manual_seed(2)
    D = n
    qkv = torch.randn(T, (H + 2 * Hkv) * D) * 3
    width = H * D if whole else D
    weight = torch.randn(width)
    got = qkv.clone()
    q = got[:, :H * D].view(T, -1, width)
    cpu_ops().rms_norm_heads_(q, weight, 1e-6)
    want = cpu_ops().rms_norm(qkv[:, :H * D].reshape(-1, width).contiguous(), weight, 1e-6)
    assert torch.equal(got[:, :H * D].reshape(-1, width), want)
    torch.testing.assert_close(want, F.rms_norm(qkv[:, :H * D].reshape(-1, width), (width,), weight, 1e-6),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, H * D:], qkv[:, H * D:])   # k and v untouched
    # the module path's norm over (T, H, D) heads is the same kernel
    norm = CpuRMSNorm(width, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(weight)
    assert torch.equal(norm(qkv[:, :H * D].view(T, -1, width)).reshape(-1, width), want)
