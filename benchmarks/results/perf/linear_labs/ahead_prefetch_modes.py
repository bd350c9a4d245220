# Lab (needs a kernel build with set_tile_pf, README.md): The model's packed linears (24 layers + lm_head), cold, M rows: in-tile T2 prefetch D k-steps ahead, by mode
# (1: every tile; 2: the first row tile when there are 2-3; 3: the first row tile when there are 1-3) vs none.
import time, statistics, torch, sys, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pdserve.kernels import cpu_ops
from model_linears import model_linears
mods = model_linears(lm_head=True)
ops = cpu_ops()
ops.set_stream(99, 0, 0)
nbytes = sum(m.packed.numel() * m.packed.element_size() for m in mods)
D = int(os.environ.get("D", "32"))
V = [(0, 0), (D, 1), (D, 2)]
Ms = [int(a) for a in sys.argv[1].split(",")]
res = {}
for r in range(int(os.environ.get("ROUNDS", "8"))):
    for M in Ms:
        xs = [torch.randn(M, m.in_features) for m in mods]
        for v in (V if r % 2 == 0 else V[::-1]):
            ops.set_tile_pf(*v)
            t = time.perf_counter()
            for m, x in zip(mods, xs): ops.packed_linear(x, m.packed, m.scale)
            res.setdefault((M, v), []).append(time.perf_counter() - t)
for M in Ms:
    base = res[(M, V[0])]
    print(f"M={M}: " + "  ".join(f"mode {v[1]} {statistics.median(res[(M, v)])*1e3:.1f} ms (x{statistics.median([b / t for b, t in zip(base, res[(M, v)])]):.3f})" for v in V), flush=True)
