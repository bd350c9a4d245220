"""The CPU decode-attention kernel reads the paged cache in place and equals the gather + SDPA path
(grouped-query heads, many blocks, ragged contexts, sliding window, bf16 cache, head size 256),
and the soft-capped torch path (Gemma 2)."""
import pytest
import torch

from pdserve.backends.cpu import layers
from pdserve.backends.cpu.kernels import cpu_ops
from tests.helpers import attention_torch_and_kernels

pytestmark = pytest.mark.usefixtures("cpu_isa")


@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (14, 2, 64), (8, 8, 32), (4, 2, 256)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_sdpa(H, Hkv, D, block_size, window, dtype):
    # one query each: inside a block, at block edges, several blocks with a partial key tile
    ctx = [1, 7, block_size, block_size + 1, 3 * block_size + 2, 60]
    want, got = attention_torch_and_kernels(H, Hkv, D, block_size, window, dtype, [1] * len(ctx), ctx,
                                            seed=H * 100 + D + block_size)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def soft_capped(monkeypatch, cap: float):
    """The helper's attention layers get the soft cap: its torch path is then PagedAttention's capped one."""
    class Capped(layers.CpuPagedAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, logit_softcap=cap, **kwargs)
    monkeypatch.setattr(layers, "CpuPagedAttention", Capped)


@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (8, 4, 256)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_kernel_equals_torch(monkeypatch, H, Hkv, D, window, dtype):
    # a cap of 2 on scores of a few units: tanh well away from linear
    soft_capped(monkeypatch, 2.0)
    ctx = [1, 7, 16, 17, 50, 60]
    want, got = attention_torch_and_kernels(H, Hkv, D, 16, window, dtype, [1] * len(ctx), ctx, seed=D + 7)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
