# Lab (needs a kernel build with set_dynamic, README.md): b-row decode steps with the linear kernel's static split and its dynamic chunks, alternating in one process.
import os, statistics
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import time_step
from pdserve.kernels import cpu_ops
e = LLMEngine("/work/q05")
ids = list(range(1000, 1000 + 4096))
BS = [int(b) for b in os.environ.get("BS", "1,4,16,32").split(",")]
res = {(b, d): [] for b in BS for d in (0, 1)}
for r in range(int(os.environ.get("ROUNDS", "6"))):
    for b in BS:
        for d in ((0, 1) if r % 2 == 0 else (1, 0)):
            cpu_ops().set_dynamic(d)
            fw, _ = time_step(e, [(1, 256)] * b, ids, int(os.environ.get("REPS", "6")))
            res[(b, d)].append(statistics.median(fw) * 1e3)
for b in BS:
    s, d = res[(b, 0)], res[(b, 1)]
    print(f"b{b}: static {statistics.median(s):.1f} dynamic {statistics.median(d):.1f} ms; dynamic/static per round " +
          " ".join(f"{y / x:.3f}" for x, y in zip(s, d)), flush=True)
