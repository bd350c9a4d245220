# Lab (the /tmp lab6 build of the morning, with set_tile_pf and set_stream; not kept in the repo): fp32 engine decode forwards (0.5B, context 256), the in-tile prefetch 32 k-steps ahead in every tile on and off, alternating in one process.
import os, statistics
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import time_step
from pdserve.kernels import cpu_ops
e = LLMEngine("/work/q05")
ops = cpu_ops()
ops.set_stream(99, 0, 0)
ids = list(range(1000, 1000 + 4096))
BS = [int(b) for b in os.environ.get("BS", "4,5,6").split(",")]
res = {}
for r in range(int(os.environ.get("ROUNDS", "8"))):
    for b in BS:
        for v in (((0, 0), (32, 1)) if r % 2 == 0 else ((32, 1), (0, 0))):
            ops.set_tile_pf(*v)
            fw, _ = time_step(e, [(1, 256)] * b, ids, int(os.environ.get("REPS", "5")))
            res.setdefault((b, v[0]), []).append(statistics.median(fw) * 1e3)
for b in BS:
    off, on = res[(b, 0)], res[(b, 32)]
    print(f"b{b}: off {statistics.median(off):.1f} on {statistics.median(on):.1f} ms; off/on per round " +
          " ".join(f"{x / y:.3f}" for x, y in zip(off, on)) + f"; median {statistics.median([x / y for x, y in zip(off, on)]):.3f}", flush=True)
