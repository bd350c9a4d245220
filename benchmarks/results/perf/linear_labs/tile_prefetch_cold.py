# Lab (needs a kernel build with set_tile_pf, README.md): The model's packed linears (24 layers + lm_head), cold, M rows: in-tile weight prefetch D k-steps ahead (T0) vs none.
import time, statistics, torch, sys, os
from pdserve.kernels import cpu_ops
from model_linears import model_linears
mods = model_linears(lm_head=True)
ops = cpu_ops()
ops.set_stream(99, 0, 0)
nbytes = sum(m.packed.numel() * m.packed.element_size() for m in mods)
Ds = [int(a) for a in os.environ.get("DS", "0,16,32,64").split(",")]
Ms = [int(a) for a in sys.argv[1].split(",")]
res = {}
for r in range(int(os.environ.get("ROUNDS", "8"))):
    for M in Ms:
        xs = [torch.randn(M, m.in_features) for m in mods]
        order = Ds if r % 2 == 0 else Ds[::-1]
        for d in order:
            ops.set_tile_pf(d, 1)
            t = time.perf_counter()
            for m, x in zip(mods, xs): ops.packed_linear(x, m.packed, m.scale)
            res.setdefault((M, d), []).append(time.perf_counter() - t)
for M in Ms:
    base = res[(M, 0)]
    print(f"M={M}: " + "  ".join(f"D={d} {statistics.median(res[(M, d)])*1e3:.1f} ms ({nbytes/statistics.median(res[(M, d)])/1e9:.1f} GB/s, x{statistics.median([b / t for b, t in zip(base, res[(M, d)])]):.3f})" for d in Ds), flush=True)
