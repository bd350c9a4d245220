# Packed linear GFLOP/s at M rows: weights cold (the 96 linears of the model once) vs hot (layer 0's qkv_proj and o_proj, 7.3 MB, repeated: in L3).
import time, statistics, torch, sys
from pdserve.kernels import cpu_ops
from model_linears import model_linears
mods = model_linears()
ops = cpu_ops()
layer0 = mods[:2]
def flops(ms, M): return sum(2 * M * m.in_features * m.packed.shape[0] * 16 for m in ms)
for M in [int(a) for a in sys.argv[1].split(",")]:
    cold, hot = [], []
    for r in range(8):
        xs = [torch.randn(M, m.in_features) for m in mods]
        t = time.perf_counter()
        for m, x in zip(mods, xs): ops.packed_linear(x, m.packed, m.scale)
        cold.append(time.perf_counter() - t)
        for _ in range(2): 
            for m, x in zip(layer0, xs): ops.packed_linear(x, m.packed, m.scale)
        t = time.perf_counter()
        for _ in range(200):
            for m, x in zip(layer0, xs): ops.packed_linear(x, m.packed, m.scale)
        hot.append(time.perf_counter() - t)
    c, h = statistics.median(cold), statistics.median(hot)
    print(f"M={M}: cold {c*1e3:.1f} ms {flops(mods, M)/c/1e9:.1f} GFLOP/s; hot (qkv+o x200, L3) {h*1e3:.1f} ms {flops(layer0, M)*200/h/1e9:.1f} GFLOP/s", flush=True)
