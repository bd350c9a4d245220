"""The CPU prefill-attention kernel reads the paged cache in place and equals the gather + masked
SDPA path: chunks that start mid-sequence (chunked prefill), ragged chunk and context lengths,
grouped-query heads, sliding windows, every head size it has, bf16 cache, decodes in the same step,
and the soft-capped torch path (Gemma 2)."""
import pytest
import torch

from pdserve.backends.cpu.kernels import cpu_ops
from tests.backends.cpu.test_decode_attention import soft_capped
from tests.helpers import attention_torch_and_kernels

pytestmark = pytest.mark.usefixtures("cpu_isa")


@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (14, 2, 64), (8, 8, 32), (4, 1, 96), (2, 2, 128), (4, 2, 256)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_sdpa(H, Hkv, D, block_size, window, dtype):
    # whole prompts, chunks after a cached prefix (not tile- or block-aligned), one long chunk, decodes
    q_lens = [2, 17, 5, 33, 1, 70, 1]
    ctx_lens = [2, 17, 21, 33 + 3 * block_size + 1, 9, 150, 1]
    want, got = attention_torch_and_kernels(H, Hkv, D, block_size, window, dtype, q_lens, ctx_lens, seed=H * 100 + D + block_size)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_long_chunk_many_threads():
    """A 2048-token context in chunks of 512, Qwen2.5-0.5B's heads: big enough to run on every thread."""
    want, got = attention_torch_and_kernels(14, 2, 64, 16, None, torch.float32, [512, 512], [512, 2048], seed=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (8, 4, 256)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_kernel_equals_torch(monkeypatch, H, Hkv, D, window, dtype):
    soft_capped(monkeypatch, 2.0)
    q_lens, ctx_lens = [2, 17, 33, 1, 70], [2, 17, 70, 9, 150]
    want, got = attention_torch_and_kernels(H, Hkv, D, 16, window, dtype, q_lens, ctx_lens, seed=D + 3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
