"""Screened argmax with many candidates per row (2000 near-copies of one direction, rows along it):
candidates per row, and the call against the full fp32 argmax, batch 32 on the 0.5B lm_head shape."""
import statistics, sys, time, torch
from torch import nn
from pdserve.kernels import cpu_ops
from pdserve.layers.packed_linear import PackedLinear
torch.manual_seed(0)
ops = cpu_ops()
N, K, M = 151936, 896, 32
v = torch.randn(K); v /= v.norm()
for spread in (0.3, 0.15, 0.1):
    # 2000 near-copies of one direction v among random columns, rows along v: their logits differ
    # by about 30 * spread, against a radius of about 0.004 * 30: tens to hundreds of candidates
    lin = nn.Linear(K, N, bias=False); nn.init.normal_(lin.weight, std=1 / K ** 0.5)   # other logits ~N(0, 1), far below 30
    with torch.no_grad():
        lin.weight[5000:7000] = v + torch.randn(2000, K) * spread / K ** 0.5
    p = PackedLinear(lin, "fp32", screen=True)
    x = (v[None, :] * 30 + torch.randn(M, K) * 0.01).contiguous()
    counts = torch.empty(M, dtype=torch.long)
    got = ops.packed_linear_argmax_screened(x, p.packed, p.screen, p.col_norm, p.col_norm_max, N, counts)
    assert torch.equal(got, ops.packed_linear_argmax(x, p.packed, p.scale, torch.empty(0), N))
    ts, tf = [], []
    for _ in range(5):
        t = time.perf_counter(); ops.packed_linear_argmax_screened(x, p.packed, p.screen, p.col_norm, p.col_norm_max, N, counts); ts.append(time.perf_counter() - t)
        t = time.perf_counter(); ops.packed_linear_argmax(x, p.packed, p.scale, torch.empty(0), N); tf.append(time.perf_counter() - t)
    c = counts.float()
    print(f"spread {spread}: candidates per row mean {c[c >= 0].mean():.0f} max {c.max():.0f} (fallback rows {(c < 0).sum().item()}); "
          f"screened {statistics.median(ts) * 1e3:.1f} ms, full {statistics.median(tf) * 1e3:.1f} ms", flush=True)
