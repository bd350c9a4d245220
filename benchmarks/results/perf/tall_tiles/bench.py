import os, sys, tempfile, time, statistics, torch
HERE = os.path.dirname(os.path.abspath(__file__))
from torch.utils.cpp_extension import load
tall = load("tall_lab", [os.path.join(HERE, "tall.cpp")], extra_cflags=["-O3", "-mavx512f", "-mfma", "-fopenmp"], extra_ldflags=["-lgomp"], build_directory=tempfile.mkdtemp(), verbose=False)
from pdserve.kernels import cpu_ops
sys.path.insert(0, os.path.join(HERE, "..", "linear_labs"))
from model_linears import model_linears   # the labs' shared setup: the 0.5B model's layer linears
ops = cpu_ops()
mods = model_linears()
print(mods[0].packed.shape, mods[0].packed.dtype, mods[0].fmt)
# correctness
x = torch.randn(16, mods[2].in_features)
ref = ops.packed_linear(x, mods[2].packed, mods[2].scale)
for v in (1, 2):
    y = tall.tall_linear(x, mods[2].packed, v)
    print("variant", v, "max diff", (y[:, :ref.shape[1]] - ref).abs().max().item())
nbytes = sum(m.packed.numel() * m.packed.element_size() for m in mods)
flops = sum(2 * m.in_features * m.packed.shape[0] * 16 for m in mods)
M = int(sys.argv[1])
res = {k: [] for k in ("packed", "tall16x1", "tall8x2")}
for r in range(8):
    xs = [torch.randn(M, m.in_features) for m in mods]
    for name in res:
        t = time.perf_counter()
        if name == "packed":
            for m, x in zip(mods, xs): ops.packed_linear(x, m.packed, m.scale)
        elif name == "tall16x1":
            for m, x in zip(mods, xs): tall.tall_linear(x, m.packed, 1)
        else:
            for m, x in zip(mods, xs): tall.tall_linear(x, m.packed, 2)
        res[name].append(time.perf_counter() - t)
for name, v in res.items():
    t = statistics.median(v)
    print(f"M={M} {name}: {t*1e3:.1f} ms, {nbytes/t/1e9:.1f} GB/s, {M*flops/t/1e9:.0f} GFLOP/s  rounds {' '.join(f'{x*1e3:.0f}' for x in v)}")
