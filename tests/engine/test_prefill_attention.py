"""The CPU prefill-attention kernel reads the paged cache in place and equals the gather + masked
SDPA path: chunks that start mid-sequence (chunked prefill), ragged chunk and context lengths,
grouped-query heads, sliding windows, every head size it has, bf16 cache, decodes in the same step."""
import pytest
import torch

from pdserve.kernels import cpu_ops
from pdserve.layers.attention import AttentionMetadata, PagedAttention, attention_context, build_group

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="CPU kernels not buildable here (no AVX-512)")


def _step(H, Hkv, D, block_size, window, dtype, q_lens, ctx_lens, seed):
    """A layer over a shuffled paged cache and one step's flat batch: the attention output of the
    torch path (masks) and of the kernels (no masks)."""
    torch.manual_seed(seed)
    tables, used = [], 0
    num_blocks = sum(-(-n // block_size) for n in ctx_lens) + 3
    perm = torch.randperm(num_blocks).tolist()
    for n in ctx_lens:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    layer = PagedAttention(H, Hkv, D, scale=D ** -0.5)
    cache = torch.randn(2, num_blocks * block_size, Hkv, D).to(dtype)
    layer.k_cache, layer.v_cache = cache[0], cache[1]
    T = sum(q_lens)
    q, k, v = torch.randn(T, H, D).to(dtype), torch.randn(T, Hkv, D).to(dtype), torch.randn(T, Hkv, D).to(dtype)
    slots, starts = [], []
    for t, ql, n in zip(tables, q_lens, ctx_lens):
        starts.append(len(slots))
        slots.extend(t[p // block_size] * block_size + p % block_size for p in range(n - ql, n))
    # as the runner groups them: decodes (one query) and prefill chunks
    groups = [[i for i, ql in enumerate(q_lens) if ql == 1], [i for i, ql in enumerate(q_lens) if ql > 1]]

    def run(with_mask):
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), groups=[
            build_group([q_lens[i] for i in g], [starts[i] for i in g], [ctx_lens[i] for i in g],
                        [tables[i] for i in g], block_size, window, "cpu", with_mask=with_mask)
            for g in groups if g])
        # no mask is what sends a group to the kernels (the layer has no other path for it)
        assert all((g.mask is None) == (not with_mask) for g in meta.groups)
        with attention_context(meta):
            return layer(q, k, v)
    return run(True), run(False)


@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (14, 2, 64), (8, 8, 32), (4, 1, 96), (2, 2, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_sdpa(H, Hkv, D, block_size, window, dtype):
    # whole prompts, chunks after a cached prefix (not tile- or block-aligned), one long chunk, decodes
    q_lens = [2, 17, 5, 33, 1, 70, 1]
    ctx_lens = [2, 17, 21, 33 + 3 * block_size + 1, 9, 150, 1]
    want, got = _step(H, Hkv, D, block_size, window, dtype, q_lens, ctx_lens, seed=H * 100 + D + block_size)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_long_chunk_many_threads():
    """A 2048-token context in chunks of 512, Qwen2.5-0.5B's heads: big enough to run on every thread."""
    want, got = _step(14, 2, 64, 16, None, torch.float32, [512, 512], [512, 2048], seed=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
