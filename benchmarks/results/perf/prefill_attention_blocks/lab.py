"""Prefill attention, the kernel of OLD_REV (16-key tiles) against the working tree's (blocks of up
to 4 x 16 keys), each built as its own extension, alternating in one process (10 rounds of 3 calls,
order reversed every round). One sequence whose last CHUNK of CTX positions are the queries.
Usage: lab.py OLD_REV H,HKV,D CTX [CHUNK]   (from the repository root)"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kernel_ab import build_old_new   # noqa: E402  (perf/kernel_ab.py)

BIND = """#include <torch/extension.h>
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                             torch::Tensor q_starts, torch::Tensor q_lens, torch::Tensor ctx_lens, torch::Tensor out,
                             int64_t block_size, double scale, int64_t sliding_window);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("prefill", &paged_prefill_attention); }
"""
old_rev, shape, L = sys.argv[1], sys.argv[2], int(sys.argv[3])
chunk = int(sys.argv[4]) if len(sys.argv) > 4 else L
mods = build_old_new("prefill_attention_cpu.cpp", old_rev, BIND, "paged_prefill_attention",
                     "prefill_attention_blocks_lab")
H, Hkv, D = (int(a) for a in shape.split(","))
bs = 16
torch.manual_seed(0)
nblk = -(-L // bs)
kc, vc = torch.randn(nblk * bs, Hkv, D), torch.randn(nblk * bs, Hkv, D)
table = torch.randperm(nblk).view(1, -1)
q = torch.randn(chunk, H, D)
args = (kc, vc, table, torch.tensor([0]), torch.tensor([chunk]), torch.tensor([L]))
outs = {v: torch.zeros(chunk, H, D) for v in mods}
for v in mods:
    mods[v].prefill(q, *args, outs[v], bs, D ** -0.5, 0)
res = {v: [] for v in mods}
for r in range(10):
    for v in (("old", "new") if r % 2 == 0 else ("new", "old")):
        t = time.perf_counter()
        for _ in range(3):
            mods[v].prefill(q, *args, outs[v], bs, D ** -0.5, 0)
        res[v].append((time.perf_counter() - t) / 3)
flops = 4.0 * D * H * chunk * (L - chunk / 2)
print(f"heads {H}/{Hkv} x {D}, context {L}, queries {chunk}: max |new - old| "
      f"{(outs['new'] - outs['old']).abs().max().item():.1e}")
for v in mods:
    print(f"  {v} {statistics.median(res[v]) * 1e3:.2f} ms  {flops / statistics.median(res[v]) / 1e9:.0f} GFLOP/s")
ratios = [b / a for a, b in zip(res["old"], res["new"])]
print("  new/old per round", " ".join(f"{x:.3f}" for x in ratios), "median", f"{statistics.median(ratios):.3f}")
