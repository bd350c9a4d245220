import torch, time, sys, os, statistics
from torch.utils.cpp_extension import load
from pdserve.kernels import cpu_ops
kp = load("kp_attn", ["/tmp/w/kp/bind.cpp", "/tmp/w/kp/attention_cpu.cpp"], build_directory="/tmp/w/kp/build",
          extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mfma", "-fopenmp"], extra_ldflags=["-lgomp"])
kp.set_cfg(0)
main = cpu_ops()
torch.manual_seed(0)
for H, Hkv, D, B, ctx, L, dt in [(14, 2, 64, 8, 128, 24, torch.float32), (14, 2, 64, 1, 128, 24, torch.float32),
                                (8, 4, 32, 32, 300, 6, torch.float32), (32, 8, 128, 8, 512, 8, torch.float32),
                                (14, 2, 64, 32, 256, 24, torch.bfloat16), (16, 16, 64, 4, 200, 8, torch.float32)]:
    bs = 16; nb = (ctx + bs - 1) // bs
    kcs = [torch.randn(B * nb * bs + 128, Hkv, D).to(dt) for _ in range(L)]
    vcs = [torch.randn(B * nb * bs + 128, Hkv, D).to(dt) for _ in range(L)]
    tables = torch.arange(B * nb).view(B, nb).contiguous().long()
    ctxl = torch.randint(max(1, ctx // 2), ctx + 1, (B,), dtype=torch.long)
    q = torch.randn(B, H, D)
    assert torch.equal(main.paged_decode_attention(q, kcs[0], vcs[0], tables, ctxl, bs, D ** -0.5, 0),
                       kp.paged_decode_attention(q, kcs[0], vcs[0], tables, ctxl, bs, D ** -0.5, 0))
    res = {"t0": [], "t2": []}
    for r in range(6):
        for name, m in ((("t0", kp), ("t2", main)) if r % 2 == 0 else (("t2", main), ("t0", kp))):
            t = time.perf_counter()
            for l in range(L): m.paged_decode_attention(q, kcs[l], vcs[l], tables, ctxl, bs, D ** -0.5, 0)
            res[name].append((time.perf_counter() - t) / L)
    print(f"H{H}/{Hkv} D{D} {str(dt)[6:]} B{B} ctx{ctx}: T0 {statistics.median(res['t0'])*1e3:.3f} ms, T2 {statistics.median(res['t2'])*1e3:.3f} ms, {statistics.median(res['t0'])/statistics.median(res['t2']):.2f}x")
