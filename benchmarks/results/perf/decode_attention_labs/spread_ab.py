"""Decode attention, the kernel of OLD_REV (the next tile's slots asked for at the tile's start)
against the working tree's (asked for in parts, one per head loop, when a task reads whole slots),
each built as its own extension, alternating in one process (ROUNDS rounds, default 15, order
reversed every other), medians; 24 / 6 / 8 layers of cold caches on huge pages per timing, as
run_labs.py. Outputs are compared bitwise first.
Usage: python benchmarks/results/perf/decode_attention_labs/spread_ab.py OLD_REV   (from the repository root)"""
import os
import statistics
import sys
import time

import torch

from pdserve import hugepages

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kernel_ab import build_old_new   # noqa: E402  (perf/kernel_ab.py)

BIND = """#include <torch/extension.h>
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t block_size,
                                     double scale, int64_t sliding_window);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("attn", &paged_decode_attention); }
"""
old_rev = sys.argv[1]
rounds = int(os.environ.get("ROUNDS", 15))
mods = build_old_new("attention_cpu.cpp", old_rev, BIND, "paged_decode_attention", "decode_attention_spread_ab")
bs = 16
torch.manual_seed(0)
print(time.strftime("%Y-%m-%d %H:%M:%S"), f"old {old_rev}, new the working tree, {rounds} rounds")
for H, Hkv, D, L, B, ctx, dt in [(14, 2, 64, 24, 32, 1024, torch.float32), (14, 2, 64, 24, 16, 1024, torch.float32),
                                 (14, 2, 64, 24, 32, 256, torch.float32), (14, 2, 64, 24, 4, 1024, torch.float32),
                                 (14, 2, 64, 24, 3, 1024, torch.float32), (14, 2, 64, 24, 1, 1024, torch.float32),
                                 (14, 2, 64, 24, 32, 512, torch.bfloat16), (8, 4, 32, 6, 32, 300, torch.float32),
                                 (8, 4, 32, 6, 1, 300, torch.float32), (32, 8, 128, 8, 8, 512, torch.float32),
                                 (16, 16, 64, 8, 16, 512, torch.float32)]:
    nb = ctx // bs
    kcs = [hugepages.empty(B * nb * bs, Hkv, D, dtype=dt).copy_(torch.randn(B * nb * bs, Hkv, D)) for _ in range(L)]
    vcs = [hugepages.empty(B * nb * bs, Hkv, D, dtype=dt).copy_(torch.randn(B * nb * bs, Hkv, D)) for _ in range(L)]
    tables = torch.randperm(B * nb).view(B, nb).contiguous()
    ctxl = torch.randint(ctx // 2, ctx + 1, (B,), dtype=torch.long)
    q = torch.randn(B, H, D)
    args = (tables, ctxl, bs, D ** -0.5, 0)
    assert torch.equal(mods["old"].attn(q, kcs[0], vcs[0], *args), mods["new"].attn(q, kcs[0], vcs[0], *args))
    res = {v: [] for v in mods}
    for r in range(rounds):
        for v in (("old", "new") if r % 2 == 0 else ("new", "old")):
            t = time.perf_counter()
            for layer in range(L):
                mods[v].attn(q, kcs[layer], vcs[layer], *args)
            res[v].append((time.perf_counter() - t) / L)
    o, n = statistics.median(res["old"]), statistics.median(res["new"])
    byts = int(ctxl.sum()) * Hkv * D * 2 * kcs[0].element_size()
    print(f"H{H}/{Hkv}x{D} {str(dt)[6:]} B{B:2d} ctx{ctx}: old {o * 1e3:.3f} ms ({byts / o / 1e9:4.1f} GB/s), "
          f"new {n * 1e3:.3f} ms ({byts / n / 1e9:4.1f} GB/s): {o / n:.3f}x")
