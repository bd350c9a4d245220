# Lab (a kernel build with cross_call_prefetch.patch applied, README.md): engine decode forwards (0.5B, context 256)
# with the next linear's first weights prefetched at the end of each thread's share, at several budgets (bytes per thread:hint), alternating in one process.
import os, statistics
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import time_step
from pdserve.kernels import cpu_ops
e = LLMEngine("/work/q05")
ops = cpu_ops()
ids = list(range(1000, 1000 + 4096))
BS = [int(b) for b in os.environ.get("BS", "1,4,16,32").split(",")]
VS = [tuple(map(int, v.split(":"))) for v in os.environ.get("VS", "0:2,131072:2,524288:2").split(",")]
res = {}
for r in range(int(os.environ.get("ROUNDS", "6"))):
    for b in BS:
        order = VS if r % 2 == 0 else VS[::-1]
        for v in order:
            ops.set_xpf(*v)
            fw, _ = time_step(e, [(1, 256)] * b, ids, int(os.environ.get("REPS", "5")))
            res.setdefault((b, v), []).append(statistics.median(fw) * 1e3)
base = VS[0]
for b in BS:
    line = f"b{b}: " + " ".join(f"{v[0]>>10}K/T{v[1]} {statistics.median(res[(b, v)]):.1f}" for v in VS) + " ms"
    for v in VS[1:]:
        rr = [x / y for x, y in zip(res[(b, base)], res[(b, v)])]
        line += f"; base/{v[0]>>10}K per round " + " ".join(f"{x:.3f}" for x in rr) + f" median {statistics.median(rr):.3f}"
    print(line, flush=True)
