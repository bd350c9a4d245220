"""The Triton paged attention (and KV write) under Triton's interpreter, against the torch path
(layers/attention.py: gather + masked SDPA, or its explicit softmax for soft caps and sinks) on
the same paged cache: mixed prefill chunks and decodes, cached prefixes, GQA, sliding windows,
soft caps, sinks, several block sizes, fp32 and bf16."""
import pytest
import torch

from pdserve.layers.attention import PagedAttention, attention_context, build_metadata


@pytest.fixture(autouse=True)
def small_key_tiles(cuda, monkeypatch):
    """Key tiles of 16: the contexts here span several, and a tile spans several blocks of 4 or 8."""
    monkeypatch.setattr(cuda.kernels, "KEY_TILE", 16)


def run_both(cuda, H, Hkv, D, block_size, q_lens, ctx_lens, dtype=torch.float32, window=None, softcap=None,
             sinks=False, seed=0):
    """(torch path's output, kernels' output, the kernel path's cache, the torch path's cache) of
    one step whose sequence i has q_lens[i] new tokens and ctx_lens[i] keys, its blocks shuffled."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in ctx_lens) + 2
    perm, used, tables = torch.randperm(num_blocks).tolist(), 0, []
    for n in ctx_lens:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    T = sum(q_lens)
    # q as a strided view of a fused qkv, as the models make it
    qkv = torch.randn(T, (H + 2 * Hkv) * D).to(dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    cache = torch.randn(2, num_blocks * block_size, Hkv, D).to(dtype)
    slots, starts = [], []
    for t, ql, n in zip(tables, q_lens, ctx_lens):
        starts.append(len(slots))
        slots.extend(t[p // block_size] * block_size + p % block_size for p in range(n - ql, n))
    # the runner's groups: decodes, then prefill chunks (any order of sequences in the flat batch)
    idx = [[i for i, ql in enumerate(q_lens) if ql == 1], [i for i, ql in enumerate(q_lens) if ql > 1]]
    groups = [([q_lens[i] for i in g], [starts[i] for i in g], [ctx_lens[i] for i in g], [tables[i] for i in g])
              for g in idx if g]
    torch_layer = PagedAttention(H, Hkv, D, D ** -0.5, window, softcap, sinks)
    if sinks:
        torch_layer.sinks.data = torch.randn(H).to(dtype)
    kernel_layer = PagedAttention(H, Hkv, D, D ** -0.5, window, softcap, sinks)
    kernel_layer.load_state_dict(torch_layer.state_dict())
    kernel_layer.__class__ = cuda.layers.CudaPagedAttention
    outs, caches = [], []
    for layer, make in ((torch_layer, None), (kernel_layer, cuda.metadata.build_step_metadata)):
        c = cache.clone()
        layer.k_cache, layer.v_cache = c[0], c[1]
        if make is None:
            _, meta = build_metadata([slots], groups, block_size, "cpu")
        else:
            _, meta = make([slots], groups, block_size, "cpu", block_q=2)
        with attention_context(meta), torch.inference_mode():
            outs.append(layer(q, k, v).float())
        caches.append(c)
    return outs[0], outs[1], caches


# (q_lens, ctx_lens): decodes, a whole prompt, a chunk after a cached prefix, all in one batch
MIXED = ([1, 5, 1, 7, 1], [9, 5, 33, 20, 1])
CASES = {
    "mha": dict(H=2, Hkv=2, D=16, block_size=4),
    "gqa": dict(H=4, Hkv=2, D=16, block_size=8),
    "gqa3-pad-heads": dict(H=6, Hkv=2, D=24, block_size=16),   # a group of 3 and a head size padded to 32
    "mqa-window": dict(H=4, Hkv=1, D=16, block_size=4, window=6),
    "softcap": dict(H=4, Hkv=2, D=16, block_size=8, softcap=5.0),
    "sinks-window": dict(H=4, Hkv=2, D=16, block_size=4, sinks=True, window=5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mixed_batch_matches_torch(cuda, name):
    ref, out, caches = run_both(cuda, q_lens=MIXED[0], ctx_lens=MIXED[1], **CASES[name])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)   # the same KV written to the same slots


@pytest.mark.parametrize("name", ["gqa", "sinks-window", "softcap"])
def test_bf16_matches_torch(cuda, name):
    ref, out, caches = run_both(cuda, q_lens=MIXED[0], ctx_lens=MIXED[1], dtype=torch.bfloat16, **CASES[name])
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)


def test_decodes_only_and_one_long_prefill(cuda):
    for q_lens, ctx_lens in (([1] * 4, [1, 2, 17, 40]), ([37], [50])):
        ref, out, _ = run_both(cuda, H=4, Hkv=2, D=16, block_size=8, q_lens=q_lens, ctx_lens=ctx_lens)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_tile_wider_than_block(cuda, monkeypatch):
    """Key tiles of 32 positions over blocks of 4: each key's own block looked up."""
    monkeypatch.setattr(cuda.kernels, "KEY_TILE", 32)
    ref, out, _ = run_both(cuda, H=2, Hkv=1, D=16, block_size=4, q_lens=[3, 1], ctx_lens=[30, 45])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_padding_slot_writes_nothing(cuda):
    """A slot of -1 (a captured batch's padding token) leaves the cache as it was."""
    cache = torch.randn(2, 8, 2, 4)
    before = cache.clone()
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    cuda.kernels.store_kv(k, v, cache[0], cache[1], torch.tensor([5, -1, 0]))
    torch.testing.assert_close(cache[0, 5], k[0])
    torch.testing.assert_close(cache[1, 0], v[2])
    unchanged = [i for i in range(8) if i not in (0, 5)]
    torch.testing.assert_close(cache[:, unchanged], before[:, unchanged])
