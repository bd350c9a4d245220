"""The group-quantized linear kernel (kernels/quant_linear_cpu.cpp, backends/cpu/quant_linear.py):
on both builds, equal to the torch reference (the dequantized weight times x in fp32) within fp32
accumulation tolerance, for 4- and 8-bit codes, groups of 16, 32, 128 and per channel, with and
without offsets, output sizes off the 64-channel tile; batch 1 and 6 (one row tile: codes widened
in registers) and 33 (more: each k-block dequantized once into a buffer the row tiles share), groups
that straddle the buffer's k-blocks; the packed form keeps no dense copy of the weight."""
import pytest
import torch
import torch.nn.functional as F

from pdserve.backends.cpu.quant_linear import QuantLinear, pack_quantized, round_to_nearest
from pdserve.layers.quantized import GroupQuantized

pytestmark = pytest.mark.usefixtures("cpu_isa")


def _codes(n_out, n_in, bits, group, offsets, seed=0):
    """Random codes over their whole range, random scales and (where asked) offsets."""
    gen = torch.Generator().manual_seed(seed)
    G = n_in // group
    if bits == 4:
        q = torch.randint(0, 16, (n_out, n_in), generator=gen, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n_out, n_in), generator=gen, dtype=torch.int8)
    scale = torch.rand(n_out, G, generator=gen) * 0.02 + 1e-3
    offset = torch.randn(n_out, G, generator=gen) * 0.05 if offsets else None
    return GroupQuantized(q, scale, offset, group, bits)


def _reference(x, gq, bias):
    return F.linear(x.double(), gq.dequantize().double(), None if bias is None else bias.double()).float()


@pytest.mark.parametrize("bits,offsets", [(4, True), (8, True), (8, False)])
@pytest.mark.parametrize("group", [16, 32, 128, "K"])
@pytest.mark.parametrize("n_out", [64, 200, 77])
@pytest.mark.parametrize("rows", [1, 6, 33])
def test_equals_dequantized_reference(bits, offsets, group, n_out, rows):
    n_in = 256 if group != "K" else 160
    gq = _codes(n_out, n_in, bits, n_in if group == "K" else group, offsets, seed=n_out + rows)
    lin = torch.nn.Linear(n_in, n_out, bias=n_out == 77)
    x = torch.randn(rows, n_in)
    got = QuantLinear(lin, gq)(x)
    want = _reference(x, gq, lin.bias)
    assert got.shape == (rows, n_out)
    # fp32 accumulation over n_in products: relative to the sum of |x * w|
    bound = (x.abs().double() @ gq.dequantize().abs().double().T).float() * 1e-6 + 1e-6
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()


def test_k_blocks_span_groups_and_rows_span_tiles():
    """K over the kernels' k-blocks (2048 inputs for one row tile, 128 for more; partial sums
    carried between blocks) and rows over a 96-row block."""
    gq = _codes(130, 4608, 4, 32, True, seed=3)
    x = torch.randn(100, 4608)
    got = QuantLinear(torch.nn.Linear(4608, 130, bias=False), gq)(x)
    torch.testing.assert_close(got, _reference(x, gq, None), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits,group", [(4, 96), (8, 48), (8, 200)])
@pytest.mark.parametrize("rows", [6, 7, 40])
def test_groups_straddling_the_dequantized_blocks(bits, group, rows):
    """Groups that end inside a 128-input k-block of the many-row path (groups of 200 span two
    blocks), on either side of its one-row-tile threshold."""
    n_in = 600 if group == 200 else 384
    gq = _codes(70, n_in, bits, group, True, seed=rows)
    x = torch.randn(rows, n_in)
    got = QuantLinear(torch.nn.Linear(n_in, 70, bias=False), gq)(x)
    bound = (x.abs().double() @ gq.dequantize().abs().double().T).float() * 1e-6 + 1e-6
    assert ((got - _reference(x, gq, None)).abs() <= bound).all()


def test_zero_rows():
    gq = _codes(64, 64, 4, 32, True)
    assert QuantLinear(torch.nn.Linear(64, 64), gq)(torch.randn(0, 64)).shape == (0, 64)


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 256)])
def test_round_to_nearest_is_close_to_the_weight(bits, group):
    w = torch.randn(96, 256)
    gq = round_to_nearest(w, bits, group)
    err = (gq.dequantize() - w).abs()
    assert (err <= gq.scale.repeat_interleave(group, dim=1) * 0.5 + 1e-6).all()
    assert err.max() > 0


def test_packed_layout_and_no_dense_copy():
    gq = _codes(70, 64, 4, 32, True)
    lin = QuantLinear(torch.nn.Linear(64, 70), gq)
    assert lin.packed.dtype == torch.uint8 and tuple(lin.packed.shape) == (128 // 16, 32, 16)
    assert tuple(lin.scale.shape) == (8, 2, 16) and tuple(lin.offset.shape) == (8, 2, 16)
    assert not any(t.dtype.is_floating_point and t.numel() >= 64 * 70 for t in lin.state_dict().values())
    # channel 17, inputs 4 and 5: panel 1, pair 2, lane 1
    b = int(lin.packed[1, 2, 1])
    assert (b & 15, b >> 4) == (int(gq.q[17, 4]), int(gq.q[17, 5]))
    assert lin.fmt == "w4 g32"
    assert QuantLinear(torch.nn.Linear(64, 70), _codes(70, 64, 8, 64, False)).fmt == "w8 per-channel"


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_rows_are_the_dequantized_rows(bits):
    gq = _codes(100, 64, bits, 16, True)
    lin = QuantLinear(torch.nn.Linear(64, 100, bias=False), gq)
    ids = torch.tensor([[0, 17], [99, 64]])
    torch.testing.assert_close(lin.weight_rows(ids), gq.dequantize()[ids], rtol=0, atol=1e-6)


def test_odd_group_of_4_bit_codes_is_refused():
    gq = GroupQuantized(torch.zeros(4, 30, dtype=torch.uint8), torch.ones(4, 2), torch.zeros(4, 2), 15, 4)
    with pytest.raises(ValueError, match="even group sizes"):
        pack_quantized(gq)
