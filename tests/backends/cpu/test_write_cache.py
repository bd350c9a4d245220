"""The decoder stack writes each step's K and V into the paged cache with its own loop
(kernels/decoder_cpu.cpp write_cache): it must store exactly what the modules' index_copy_ of
x.to(cache dtype) stores, a bf16 cache rounded to nearest even as torch rounds, and refuse a slot
outside the cache."""
import pytest
import torch

from pdserve.backends.cpu.kernels import cpu_ops

pytestmark = pytest.mark.usefixtures("cpu_isa")


def kv_rows(T: int, Hkv: int, D: int, seed: int) -> torch.Tensor:
    """(T, Hkv, D) fp32 rows as the stack passes them: a view into a wider qkv product (row stride
    larger than Hkv x D). Some values sit exactly halfway between two bf16 numbers, where rounding
    to nearest even and truncation (or rounding half up) differ."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, 3 * Hkv * D, generator=g)
    bits = qkv.view(torch.int32)
    # low 16 bits 0x8000: a tie. With bit 16 clear, even rounds down; with it set, up.
    bits[:, ::3] = (bits[:, ::3] & ~0xFFFF) | 0x8000
    bits[:, 3::6] |= 0x10000
    return qkv[:, Hkv * D:2 * Hkv * D].view(T, Hkv, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 300])   # 300 rows: the loop runs on both threads
def test_write_cache_equals_index_copy(dtype, T):
    Hkv, D, slots_total = 2, 64, 512
    x = kv_rows(T, Hkv, D, seed=T)
    assert T == 1 or x.stride(0) == 3 * Hkv * D   # rows apart as in the qkv product
    slots = torch.randperm(slots_total)[:T]
    want = torch.randn(slots_total, Hkv, D).to(dtype)
    got = want.clone()
    want.index_copy_(0, slots, x.to(dtype))
    cpu_ops().write_cache(got, x, slots)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_bf16_ties_round_to_even():
    # the cases themselves, not only agreement with torch: 1 + 2^-8 lies halfway between bf16's
    # 1 and 1 + 2^-7, and rounds to 1 (even); 1 + 3 * 2^-8 rounds up to 1 + 2^-6
    x = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)]).view(3, 1, 1).expand(3, 1, 16).contiguous()
    cache = torch.zeros(3, 1, 16, dtype=torch.bfloat16)
    cpu_ops().write_cache(cache, x, torch.arange(3))
    assert cache[:, 0, 0].float().tolist() == [1.0, 1 + 2 ** -6, -1.0]


def test_write_cache_refuses_bad_slots_and_shapes():
    ops = cpu_ops()
    cache = torch.zeros(8, 2, 16)
    x = torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.write_cache(cache, x, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.write_cache(cache, x, torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match="one int64 slot per row"):
        ops.write_cache(cache, x, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="rows of 32 elements"):
        ops.write_cache(torch.zeros(8, 1, 16), x, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="fp32 or bf16 cache"):
        ops.write_cache(torch.zeros(8, 2, 16, dtype=torch.float16), x, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="fp32 and contiguous"):
        ops.write_cache(cache, x.double(), torch.tensor([0, 1]))
    assert cache.abs().sum() == 0   # nothing written by a refused call
