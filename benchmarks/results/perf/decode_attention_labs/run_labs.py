"""The decode-attention labs (make_labs.py writes their kernels first) against the kernel as built
in the package, Qwen-0.5B heads (14 / 2 x 64), block size 16, caches on huge pages as the engine
allocates them (hugepages.empty), 24 layers of cold caches per timing (one, reused, where it says
hot), variants alternating in one process (7 rounds, order reversed every other), medians.
Usage: python run_labs.py ahead|skip|dmajor   (from the repository root)"""
import os
import statistics
import sys
import time

import torch
from torch.utils.cpp_extension import load

from pdserve import hugepages
from pdserve.kernels import CFLAGS, _DIR, cpu_ops

LAB_DIR = os.environ.get("LAB_DIR", "/tmp/decode_attention_labs")
which = sys.argv[1]
os.makedirs(os.path.join(LAB_DIR, "build_" + which), exist_ok=True)
lab = load("decode_attention_lab_" + which, [os.path.join(LAB_DIR, f"att_{which}.cpp")], extra_include_paths=[_DIR],
           extra_cflags=CFLAGS, extra_ldflags=["-lgomp"], build_directory=os.path.join(LAB_DIR, "build_" + which))
main = cpu_ops()
H, Hkv, D, bs, L = 14, 2, 64, 16, 24
scale = D ** -0.5
torch.manual_seed(0)


def caches(n, rows, dt):
    return [hugepages.empty(rows, Hkv, D, dtype=dt).copy_(torch.randn(rows, Hkv, D)) for _ in range(n)]


def timed(variants, rounds=7):
    """variants: name -> callable(layer); median seconds per layer"""
    res = {v: [] for v in variants}
    names = list(variants)
    for r in range(rounds):
        for v in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            for layer in range(L):
                variants[v](layer)
            res[v].append((time.perf_counter() - t) / L)
    return {v: statistics.median(x) for v, x in res.items()}


cases = [(32, 1024, torch.float32), (16, 1024, torch.float32), (32, 256, torch.float32), (4, 1024, torch.float32),
         (1, 1024, torch.float32), (32, 512, torch.bfloat16)]
print(time.strftime("%Y-%m-%d %H:%M:%S"), which)
if which == "skip":
    for B, ctx, dt, hot in [(32, 1024, torch.float32, False), (32, 256, torch.float32, False),
                            (4, 256, torch.float32, True), (32, 1024, torch.bfloat16, False)]:
        nb = ctx // bs
        n = 1 if hot else L
        kcs, vcs = caches(n, B * nb * bs, dt), caches(n, B * nb * bs, dt)
        tables = torch.randperm(B * nb).view(B, nb).contiguous()
        ctxl = torch.full((B,), ctx, dtype=torch.long)
        q = torch.randn(B, H, D)

        def variant(c):
            def f(layer):
                lab.set_skip(c)
                lab.attn(q, kcs[layer % n], vcs[layer % n], tables, ctxl, bs, scale, 0)
            return f
        m = timed({c: variant(c) for c in (0, 1, 2)})
        print(f"B{B} ctx{ctx} {str(dt)[6:]} {'hot' if hot else 'cold'}: both passes {m[0]*1e3:.3f} ms, "
              f"pass 1 only {m[1]*1e3:.3f}, pass 2 only {m[2]*1e3:.3f}")
    sys.exit()
for B, ctx, dt in cases:
    nb = ctx // bs
    kcs, vcs = caches(L, B * nb * bs, dt), caches(L, B * nb * bs, dt)
    tables = torch.arange(B * nb).view(B, nb).contiguous() if which == "ahead" else \
        torch.randperm(B * nb).view(B, nb).contiguous()
    ctxl = torch.randint(ctx // 2, ctx + 1, (B,), dtype=torch.long)
    q = torch.randn(B, H, D)
    ref = main.paged_decode_attention(q, kcs[0], vcs[0], tables, ctxl, bs, scale, 0)
    byts = int(ctxl.sum()) * Hkv * D * 2 * kcs[0].element_size()
    if which == "ahead":
        aheads = (1, 2, 4, 0)
        for a in aheads:
            lab.set_ahead(a)
            assert torch.equal(ref, lab.attn(q, kcs[0], vcs[0], tables, ctxl, bs, scale, 0))

        def variant(a):
            def f(layer):
                lab.set_ahead(a)
                lab.attn(q, kcs[layer], vcs[layer], tables, ctxl, bs, scale, 0)
            return f
        m = timed({a: variant(a) for a in aheads})
        print(f"B{B} ctx{ctx} {str(dt)[6:]}: " + "  ".join(
            f"ahead {a}: {m[a]*1e3:.3f} ms {byts/m[a]/1e9:4.1f} GB/s ({m[1]/m[a]:.3f}x)" for a in aheads))
    else:
        # the same keys in the d-major layout: (blocks, Hkv, D, 16)
        kts = [hugepages.empty(k.shape[0] // bs, Hkv, D, bs, dtype=dt).copy_(k.view(-1, bs, Hkv, D).permute(0, 2, 3, 1))
               for k in kcs]
        err = (ref - lab.attn(q, kts[0].view(-1, Hkv, D), vcs[0], tables, ctxl, bs, scale, 0)).abs().max().item()
        m = timed({"old": lambda layer: main.paged_decode_attention(q, kcs[layer], vcs[layer], tables, ctxl, bs, scale, 0),
                   "new": lambda layer: lab.attn(q, kts[layer].view(-1, Hkv, D), vcs[layer], tables, ctxl, bs, scale, 0)})
        fl = int(ctxl.sum()) * H * D * 4
        print(f"B{B:2d} ctx{ctx} {str(dt)[6:]}: slot-major {m['old']*1e3:.3f} ms ({fl/m['old']/1e9:5.1f} GFLOP/s "
              f"{byts/m['old']/1e9:4.1f} GB/s)  d-major {m['new']*1e3:.3f} ms ({fl/m['new']/1e9:5.1f} GFLOP/s "
              f"{byts/m['new']/1e9:4.1f} GB/s)  {m['old']/m['new']:.3f}x  max|diff| {err:.1e}")
