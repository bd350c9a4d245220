# Lab (needs a kernel build with set_stream, README.md): the streaming kernel against the tile kernel, hot (layer 0's qkv_proj and o_proj from L3).
import time, statistics, torch, sys, os
from pdserve.kernels import cpu_ops
from model_linears import model_linears
mods = model_linears()[:2]   # layer 0's qkv_proj and o_proj
ops = cpu_ops()
PF = int(os.environ.get("PF", "64"))
for M in [int(a) for a in sys.argv[1].split(",")]:
    xs = [torch.randn(M, m.in_features) for m in mods]
    res = {}
    for r in range(6):
        for v, args in (("tile", (99, 0, 0)), ("stream", (7, 16, 0)), ("stream_pf", (7, 16, PF))):
            ops.set_stream(*args)
            for m, x in zip(mods, xs): ops.packed_linear(x, m.packed, m.scale)
            t = time.perf_counter()
            for _ in range(100):
                for m, x in zip(mods, xs): ops.packed_linear(x, m.packed, m.scale)
            res.setdefault(v, []).append(time.perf_counter() - t)
    fl = 100 * sum(2 * M * m.in_features * m.packed.shape[0] * 16 for m in mods)
    print(f"M={M} hot (L3): " + "  ".join(f"{v} {fl / statistics.median(t) / 1e9:.0f} GFLOP/s" for v, t in res.items()), flush=True)
