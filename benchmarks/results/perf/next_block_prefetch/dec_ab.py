import sys, statistics, os
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import time_step
import pdserve
e = LLMEngine("/work/q05")
ids = list(range(1000, 1000 + 4096))
out = []
for B in [int(b) for b in os.environ.get("BS", "32,24,16,4,1").split(",")]:
    fw, _ = time_step(e, [(1, 256)] * B, ids, int(os.environ.get("REPS", "12")))
    out.append(f"b{B} {statistics.median(fw)*1e3:.1f}")
print(os.path.dirname(pdserve.__file__).split("/")[2], " ".join(out), flush=True)
