"""The bf16 k-pair products on AMX tiles (kernels/amx_tiles.h): where the CPU has AMX-BF16 they take
batches of 8 rows and more at K a multiple of 32, with the same result as the AVX512-BF16 dot
products (exact bf16 products, fp32 sums) for every row count, tail rows and row blocks included,
and the fused argmax policies read their tiles as they read the dot products'."""
import pytest
import torch
import torch.nn.functional as F

from pdserve.backends.cpu.kernels import _cpu_flags, cpu_ops
from pdserve.backends.cpu.packed_linear import PackedLinear

pytestmark = pytest.mark.usefixtures("cpu_isa", "bf16_dot")


@pytest.fixture
def amx(bf16_dot):
    """The tiles on for the test (the dot products after it as before); skips where the CPU has none."""
    if "amx_bf16" not in _cpu_flags():
        pytest.skip("this CPU has no AMX-BF16")
    assert cpu_ops().set_amx(1), "the CPU has AMX-BF16 but the kernels cannot use it"
    yield
    cpu_ops().set_amx(1)


def _layer(n_out, n_in, bias=False):
    torch.manual_seed(n_out + n_in)
    lin = torch.nn.Linear(n_in, n_out, bias=bias)
    return lin, PackedLinear(lin, "bf16")


@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("n_out,n_in", [(64, 32), (200, 96), (1152, 896)])
@pytest.mark.parametrize("rows", [8, 13, 16, 17, 32, 97, 300])   # tails of a tile; 300: two row blocks
def test_tiles_equal_the_bf16_product(n_out, n_in, rows):
    lin, packed = _layer(n_out, n_in, bias=True)
    x = torch.randn(rows, n_in)
    want = F.linear(x.bfloat16().float(), lin.weight.bfloat16().float(), lin.bias)   # exact products, fp32 sums
    got = packed(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cpu_ops().set_amx(0)
    dots = packed(x)
    torch.testing.assert_close(dots, got, rtol=1e-5, atol=1e-5)
    # the tiles ran: they sum in another order than the dot products, so some outputs round apart
    assert not torch.equal(dots, got)


@pytest.mark.usefixtures("amx")
@pytest.mark.parametrize("rows", [8, 20, 40])
def test_fused_argmax_reads_the_tiles(rows):
    """The argmax over the tiles' logits is the argmax of the very logits the dense product writes
    (same tiles, same sums): a policy that read another row or group would differ."""
    _, packed = _layer(3000, 128)
    x = torch.randn(rows, 128)
    assert torch.equal(packed.argmax(x), packed(x).argmax(dim=-1))


def test_k_not_a_multiple_of_32_takes_the_dot_products():
    lin, packed = _layer(200, 98)   # k-pairs, but no whole 32-wide A tile
    x = torch.randn(16, 98)
    want = F.linear(x.bfloat16().float(), lin.weight.bfloat16().float())
    torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)
