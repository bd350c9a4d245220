# Lab (a kernel build with dp_ahead.patch applied, README.md): bf16 engine decode forwards (0.5B, context 256) with the
# 32-k-pair-step prefetch in micro_dp: 0 off, 1 at 2-3 row tiles (the fp32 rule), 2 at every tile count; alternating in one process.
import os, statistics
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import time_step
from pdserve.kernels import cpu_ops
e = LLMEngine("/work/q05", dtype="bfloat16")
ops = cpu_ops()
ids = list(range(1000, 1000 + 4096))
BS = [int(b) for b in os.environ.get("BS", "8,12,16").split(",")]
res = {}
VS = [int(v) for v in os.environ.get("VS", "0,1").split(",")]
for r in range(int(os.environ.get("ROUNDS", "8"))):
    for b in BS:
        for v in (VS if r % 2 == 0 else VS[::-1]):
            ops.set_dp_ahead(v)
            fw, _ = time_step(e, [(1, 256)] * b, ids, int(os.environ.get("REPS", "5")))
            res.setdefault((b, v), []).append(statistics.median(fw) * 1e3)
for b in BS:
    base = res[(b, VS[0])]
    line = f"b{b}: " + " ".join(f"v{v} {statistics.median(res[(b, v)]):.1f}" for v in VS) + " ms"
    for v in VS[1:]:
        rr = [x / y for x, y in zip(base, res[(b, v)])]
        line += f"; v{VS[0]}/v{v} per round " + " ".join(f"{x:.3f}" for x in rr) + f" median {statistics.median(rr):.3f}"
    print(line, flush=True)
