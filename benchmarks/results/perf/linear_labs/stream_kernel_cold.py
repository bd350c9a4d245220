# Lab (needs a kernel build with set_stream, README.md): the single-pass streaming kernel against the tile kernel, bitwise and cold (the model's 96 linears).
import time, statistics, torch, sys, os
from pdserve.kernels import cpu_ops
from model_linears import model_linears
mods = model_linears()
ops = cpu_ops()
# bitwise: stream path against the tile path
for M in (7, 12, 16):
    for m in mods[:4]:
        x = torch.randn(M, m.in_features)
        ops.set_stream(7, 16, 0); a = ops.packed_linear(x, m.packed, m.scale).clone()
        ops.set_stream(99, 0, 0); b = ops.packed_linear(x, m.packed, m.scale).clone()
        assert torch.equal(a, b), (M, (a - b).abs().max())
print("bitwise equal")
PF = int(os.environ.get("PF", "0"))
Ms = [int(a) for a in sys.argv[1].split(",")]
res = {}
for r in range(int(os.environ.get("ROUNDS", "8"))):
    for M in Ms:
        xs = [torch.randn(M, m.in_features) for m in mods]
        for v, args in (("tile", (99, 0, 0)), ("stream", (7, 16, 0)), ("stream_pf", (7, 16, PF))):
            if v == "stream_pf" and not PF: continue
            ops.set_stream(*args)
            t = time.perf_counter()
            for m, x in zip(mods, xs): ops.packed_linear(x, m.packed, m.scale)
            res.setdefault((M, v), []).append(time.perf_counter() - t)
flops = lambda M: sum(2 * M * m.in_features * m.packed.shape[0] * 16 for m in mods)
for M in Ms:
    base = statistics.median(res[(M, "tile")])
    line = f"M={M}: "
    for v in ("tile", "stream", "stream_pf"):
        if (M, v) in res:
            t = statistics.median(res[(M, v)])
            line += f"{v} {t*1e3:.1f} ms {flops(M)/t/1e9:.0f} GFLOP/s ({base/t:.3f}x)  "
    print(line, flush=True)
