import os, sys, tempfile, time, statistics, torch
HERE = os.path.dirname(os.path.abspath(__file__))
from torch.utils.cpp_extension import load
tall = load("tall_lab", [os.path.join(HERE, "tall.cpp")], extra_cflags=["-O3", "-mavx512f", "-mfma", "-fopenmp"], extra_ldflags=["-lgomp"], build_directory=tempfile.mkdtemp(), verbose=False)
from pdserve.kernels import cpu_ops
from pdserve.layers.packed_linear import PackedLinear
ops = cpu_ops()
M = int(sys.argv[1])
for K, N in ((896, 896), (896, 4864)):
    lin = torch.nn.Linear(K, N, bias=False)
    p = PackedLinear(lin, "fp32")
    x = torch.randn(M, K)
    res = {}
    for name, f in (("packed", lambda: ops.packed_linear(x, p.packed, p.scale)), ("16x1", lambda: tall.tall_linear(x, p.packed, 1)), ("8x2", lambda: tall.tall_linear(x, p.packed, 2))):
        for _ in range(20): f()
        ts = []
        for _ in range(200):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        t = statistics.median(ts)
        res[name] = t
        print(f"hot M={M} K={K} N={N} {name}: {t*1e6:.0f} us {2*M*K*N/t/1e9:.0f} GFLOP/s")
