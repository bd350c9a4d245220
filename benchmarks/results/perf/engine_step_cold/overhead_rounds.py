# Engine overhead (step minus forward, median of 64 decode steps) per round; usage: overhead_rounds.py BATCH ROUNDS
import sys
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import engine_overhead
e = LLMEngine("pdserve/data/default-model")
ids = list(range(5, 5 + 128))
for r in range(int(sys.argv[2])):
    o = engine_overhead(e, int(sys.argv[1]), 128, ids, steps=64)
    print(f"overhead {o['overhead_ms']:.4f} step {o['step_ms']:.3f}", flush=True)
