# Engine overhead (tiny model, decode batch B), requests streamed against final_only, alternating in one process.
import os, statistics
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import engine_overhead
e = LLMEngine(os.environ.get("MODEL", "/work/main/pdserve/data/default-model"))
ids = list(range(5, 5 + 128))
B = int(os.environ.get("B", "32"))
res = {False: [], True: []}
for r in range(int(os.environ.get("ROUNDS", "8"))):
    for fo in ((False, True) if r % 2 == 0 else (True, False)):
        o = engine_overhead(e, B, 128, ids, steps=int(os.environ.get("STEPS", "64")), final_only=fo)
        res[fo].append(o["overhead_ms"])
s, f = res[False], res[True]
print(f"b{B}: streamed {statistics.median(s):.3f} ms, final_only {statistics.median(f):.3f} ms; final/streamed per round " +
      " ".join(f"{y / x:.2f}" for x, y in zip(s, f)) + f"; median {statistics.median([y / x for x, y in zip(s, f)]):.2f}")
