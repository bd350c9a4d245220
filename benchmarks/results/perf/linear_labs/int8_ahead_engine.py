# Lab (the /tmp build: int8_ahead.patch is the version tried for main; the lab had a settable mode and distance, set_i8_pf): int8 engine decode forwards (0.5B, context 256), a prefetch DIST k-steps ahead in
# the int8 tile (one line per 4 k-steps), at every tile count, on and off, alternating in one process.
import os, statistics
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import time_step
from pdserve.kernels import cpu_ops
e = LLMEngine("/work/q05", quantization="int8")
ops = cpu_ops()
ids = list(range(1000, 1000 + 4096))
BS = [int(b) for b in os.environ.get("BS", "1,4,6,12,16,24,32").split(",")]
VS = [tuple(map(int, v.split(":"))) for v in os.environ.get("VS", "0:128,1:128").split(",")]
res = {}
for r in range(int(os.environ.get("ROUNDS", "6"))):
    for b in BS:
        for v in (VS if r % 2 == 0 else VS[::-1]):
            ops.set_i8_pf(*v)
            fw, _ = time_step(e, [(1, 256)] * b, ids, int(os.environ.get("REPS", "5")))
            res.setdefault((b, v), []).append(statistics.median(fw) * 1e3)
for b in BS:
    base = res[(b, VS[0])]
    line = f"b{b}: " + " ".join(f"{v} {statistics.median(res[(b, v)]):.1f}" for v in VS) + " ms"
    for v in VS[1:]:
        rr = [x / y for x, y in zip(base, res[(b, v)])]
        line += f"; off/{v} per round " + " ".join(f"{x:.3f}" for x in rr) + f" median {statistics.median(rr):.3f}"
    print(line, flush=True)
