"""The CPU decode-attention kernel reads the paged cache in place and equals the gather + SDPA path
(grouped-query heads, many blocks, ragged contexts, sliding window, bf16 cache)."""
import pytest
import torch

from pdserve.kernels import cpu_ops
from pdserve.layers.attention import AttentionMetadata, PagedAttention, attention_context, build_group

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="CPU kernels not buildable here (no AVX-512)")


def _run(layer, q, k, v, meta):
    with attention_context(meta):
        return layer(q, k, v)


@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (14, 2, 64), (8, 8, 32)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_sdpa(H, Hkv, D, block_size, window, dtype):
    torch.manual_seed(H * 100 + D + block_size)
    num_blocks = 64
    ctx = [1, 7, block_size, block_size + 1, 3 * block_size + 2, 60]
    B = len(ctx)
    # each sequence owns distinct, shuffled blocks (a real paged layout)
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in ctx:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    layer = PagedAttention(H, Hkv, D, scale=D ** -0.5)
    cache = torch.randn(2, num_blocks * block_size, Hkv, D).to(dtype)
    layer.k_cache, layer.v_cache = cache[0], cache[1]
    q = torch.randn(B, H, D).to(dtype)
    k = torch.randn(B, Hkv, D).to(dtype)
    v = torch.randn(B, Hkv, D).to(dtype)
    slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, ctx)])
    def meta(with_mask):
        return AttentionMetadata(slot_mapping=slots, groups=[
            build_group([1] * B, list(range(B)), ctx, tables, block_size, window, "cpu", with_mask=with_mask)])
    want = _run(layer, q, k, v, meta(True))    # torch: gather blocks, masked SDPA
    got = _run(layer, q, k, v, meta(False))    # no mask: the CPU decode kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
