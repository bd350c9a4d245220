"""Prefill of 2048 tokens with the screen on and off by turns in one process: the screen touches only
the one sampled row's lm_head, and roofline runs 11 and 12 put prefill 2048 at 83% of the peak.
Usage: prefill_ab.py MODEL"""
import sys
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import time_step
e = LLMEngine(sys.argv[1], max_model_len=4096)
lm = e.runner.model.lm_head
ids = list(range(100, 100 + 2048))
for r in range(3):
    for v in ((True, False) if r % 2 == 0 else (False, True)):
        lm.use_screen = v
        f, x = time_step(e, [(2048, 2048)], ids, 1)
        print("screen", v, "prefill 2048 forward ms", round(f[0] * 1e3, 1), flush=True)
