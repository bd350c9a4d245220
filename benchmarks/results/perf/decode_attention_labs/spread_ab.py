"""Decode attention, the kernel of OLD_REV (the next tile's slots asked for at the tile's start)
against the working tree's (asked for in parts, one per head loop, when a task reads whole slots),
each built as its own extension, alternating in one process (ROUNDS rounds, default 15, order
reversed every other), medians; 24 / 6 / 8 layers of cold caches on huge pages per timing, as
run_labs.py. Outputs are compared bitwise first.
Usage: python benchmarks/results/perf/decode_attention_labs/spread_ab.py OLD_REV   (from the repository root)"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.cpp_extension import load

from pdserve import hugepages
from pdserve.kernels import CFLAGS, _DIR

BIND = """#include <torch/extension.h>
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t block_size,
                                     double scale, int64_t sliding_window);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("attn", &paged_decode_attention); }
"""
old_rev = sys.argv[1]
rounds = int(os.environ.get("ROUNDS", 15))
work = os.path.join(tempfile.gettempdir(), "decode_attention_spread_ab")
sources = {"old": subprocess.run(["git", "show", f"{old_rev}:pdserve/kernels/attention_cpu.cpp"],
                                 capture_output=True, text=True, check=True).stdout,
           "new": open(os.path.join(_DIR, "attention_cpu.cpp")).read()}
mods = {}
for v, src in sources.items():
    d = os.path.join(work, v)
    os.makedirs(os.path.join(d, "build"), exist_ok=True)
    for name, text in (("kernel.cpp", src), ("bind.cpp", BIND)):
        path = os.path.join(d, name)
        if not os.path.exists(path) or open(path).read() != text:
            open(path, "w").write(text)
    mods[v] = load(f"decode_attention_ab_{v}", [os.path.join(d, "kernel.cpp"), os.path.join(d, "bind.cpp")],
                   # a name of its own: two libraries exporting one symbol, the first loaded serves both
                   extra_include_paths=[_DIR], extra_cflags=CFLAGS + [f"-Dpaged_decode_attention=attention_{v}"],
                   extra_ldflags=["-lgomp"],
                   build_directory=os.path.join(d, "build"))
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
