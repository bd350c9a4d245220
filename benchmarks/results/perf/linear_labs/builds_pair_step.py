# One process of an old/new builds pair (PYTHONPATH picks the checkout): engine decode forwards at DTYPE (QUANT: int8), median ms per batch; prints "label build dtype quant b:ms ..."
import os, statistics, sys
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import time_step
import pdserve.kernels as k
dtype = os.environ.get("DTYPE", "bfloat16")
q = os.environ.get("QUANT") or None
e = LLMEngine("/work/q05", dtype=dtype, quantization=q)
ids = list(range(1000, 1000 + 4096))
out = []
for b in [int(x) for x in os.environ.get("BS", "6,12,24,32").split(",")]:
    fw, _ = time_step(e, [(1, 256)] * b, ids, int(os.environ.get("REPS", "8")))
    out.append(f"{b}:{statistics.median(fw) * 1e3:.1f}")
print(sys.argv[1], k.build_name()[-12:], dtype, q, " ".join(out), flush=True)
