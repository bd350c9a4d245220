# Engine overhead (decode batch B, context 128+), with the persistent decode batch on and off, alternating in one process.
# usage: B=32 ROUNDS=10 MODEL=... python decode_batch_ab.py
import os, statistics
from pdserve.engine.decode_batch import DecodeBatch
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import engine_overhead
e = LLMEngine(os.environ.get("MODEL", "pdserve/data/default-model"))
ids = list(range(5, 5 + 128))
B = int(os.environ.get("B", "32"))
on = e.runner.decode_batch
res = {"off": [], "on": []}
for r in range(int(os.environ.get("ROUNDS", "10"))):
    for v in (("off", "on") if r % 2 == 0 else ("on", "off")):
        e.runner.decode_batch = on if v == "on" else None
        o = engine_overhead(e, B, 128, ids, steps=int(os.environ.get("STEPS", "64")))
        res[v].append(o["overhead_ms"])
a, b = res["off"], res["on"]
print(f"b{B}: off {statistics.median(a):.3f} ms, on {statistics.median(b):.3f} ms; on/off per round " +
      " ".join(f"{y / x:.2f}" for x, y in zip(a, b)) + f"; median {statistics.median([y / x for x, y in zip(a, b)]):.2f}", flush=True)
