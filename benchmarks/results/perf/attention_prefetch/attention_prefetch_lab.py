import torch, time, sys, os, statistics
from torch.utils.cpp_extension import load
os.makedirs("/tmp/w/kp/build", exist_ok=True)
kp = load("kp_attn", ["/tmp/w/kp/bind.cpp", "/tmp/w/kp/attention_cpu.cpp"], build_directory="/tmp/w/kp/build",
          extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mfma", "-fopenmp"], extra_ldflags=["-lgomp"])
if "build" in sys.argv: sys.exit()
torch.manual_seed(0)
H, Hkv, D, bs, L = 14, 2, 64, 16, 24
cfgs = [int(c) for c in sys.argv[1].split(",")]
for B, ctx, layout in [(32, 1024, "random"), (32, 1024, "contiguous"), (32, 256, "contiguous"), (4, 1024, "contiguous"), (1, 1024, "contiguous")]:
    nb = (ctx + bs - 1) // bs
    kcs = [torch.randn(B * nb * bs + 128, Hkv, D) for _ in range(L)]
    vcs = [torch.randn(B * nb * bs + 128, Hkv, D) for _ in range(L)]
    tables = (torch.randperm(B * nb) if layout == "random" else torch.arange(B * nb)).view(B, nb).contiguous().long()
    ctxl = torch.full((B,), ctx, dtype=torch.long)
    q = torch.randn(B, H, D)
    res = {c: [] for c in cfgs}
    for r in range(5):
        for c in (cfgs if r % 2 == 0 else cfgs[::-1]):
            kp.set_cfg(c)
            t = time.perf_counter()
            for l in range(L): kp.paged_decode_attention(q, kcs[l], vcs[l], tables, ctxl, bs, D ** -0.5, 0)
            res[c].append((time.perf_counter() - t) / L)
    byt = B * ctx * Hkv * D * 4 * 2
    base = statistics.median(res[cfgs[0]])
    print(f"B{B} ctx{ctx} {layout:10s} " + "  ".join(f"cfg{c}: {byt/statistics.median(res[c])/1e9:5.1f} GB/s ({base/statistics.median(res[c]):.2f}x)" for c in cfgs))
