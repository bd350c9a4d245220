"""The CUDA backend's attention against the torch path (layers/attention.py: gather + masked SDPA,
or its explicit softmax for soft caps and sinks) on one paged cache, for test_attention_kernel.py
(Triton's interpreter, CPU) and test_gpu.py (compiled, CUDA)."""
import torch

from pdserve.layers.attention import PagedAttention, attention_context, build_metadata


def run_both(cuda, H, Hkv, D, block_size, q_lens, ctx_lens, dtype=torch.float32, window=None, softcap=None,
             sinks=False, seed=0, device="cpu", block_q=2, kv_splits=1):
    """(torch path's output in fp32, kernels' output, [the torch path's cache, the kernels'] in fp32) of
    one step whose sequence i has q_lens[i] new tokens and ctx_lens[i] keys, its blocks shuffled.
    cuda: the backend's modules (kernels, layers, metadata); block_q: queries per kernel tile;
    kv_splits: programs sharing a tile's keys."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in ctx_lens) + 2
    perm, used, tables = torch.randperm(num_blocks).tolist(), 0, []
    for n in ctx_lens:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    T = sum(q_lens)
    # q as a strided view of a fused qkv, as the models make it
    qkv = torch.randn(T, (H + 2 * Hkv) * D).to(device, dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    cache = torch.randn(2, num_blocks * block_size, Hkv, D).to(device, dtype)
    slots, starts = [], []
    for t, ql, n in zip(tables, q_lens, ctx_lens):
        starts.append(len(slots))
        slots.extend(t[p // block_size] * block_size + p % block_size for p in range(n - ql, n))
    # the runner's groups: decodes, then prefill chunks (any order of sequences in the flat batch)
    idx = [[i for i, ql in enumerate(q_lens) if ql == 1], [i for i, ql in enumerate(q_lens) if ql > 1]]
    groups = [([q_lens[i] for i in g], [starts[i] for i in g], [ctx_lens[i] for i in g], [tables[i] for i in g])
              for g in idx if g]
    # the reference in fp32 from the same (rounded) numbers: a bf16 reference's own rounding would
    # swamp the kernel's
    torch_layer = PagedAttention(H, Hkv, D, D ** -0.5, window, softcap, sinks).to(device)
    kernel_layer = PagedAttention(H, Hkv, D, D ** -0.5, window, softcap, sinks).to(device, dtype)
    if sinks:
        kernel_layer.sinks.data = torch.randn(H).to(device, dtype)
        torch_layer.sinks.data = kernel_layer.sinks.data.float()
    kernel_layer.__class__ = cuda.layers.CudaPagedAttention
    outs, caches = [], []
    for layer, make, x in ((torch_layer, None, torch.float32), (kernel_layer, cuda.metadata.build_step_metadata, dtype)):
        c = cache.to(x, copy=True)
        layer.k_cache, layer.v_cache = c[0], c[1]
        if make is None:
            _, meta = build_metadata([slots], groups, block_size, device)
        else:
            _, meta = make([slots], groups, block_size, device, block_q=block_q)
            meta.kv_splits = kv_splits
        with attention_context(meta), torch.inference_mode():
            outs.append(layer(q.to(x), k.to(x), v.to(x)).float())
        caches.append(c.float())
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
