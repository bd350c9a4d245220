"""The c32 workload offline (64 prompts of 128 random ids, 128 greedy tokens, 32 at a time), with the
engine built and stepped on the main thread (`main`), built on the main thread and stepped on
another (`thread`, what the server did before EngineThread), or both on another thread (`both`).
Prints the median batch-32 decode step. Usage: python offline_threads.py MODEL main|thread|both"""
import random
import statistics
import sys

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams
from pdserve.server.async_engine import EngineThread


def build():
    llm = LLM(sys.argv[1], max_num_seqs=32)
    llm.generate([[5] * 8], SamplingParams(max_tokens=4, ignore_eos=True))   # warm-up
    return llm.engine


def run(engine) -> list[float]:
    rng = random.Random(0)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"q{i}", [rng.randrange(100, 150000) for _ in range(128)], params)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.last_step
        if s.num_decode_tokens == 32 and not s.num_prefill_tokens:
            steps.append(s.duration)
    return steps


mode = sys.argv[2]
other = EngineThread()   # the server's engine thread
engine = other.call(build) if mode == "both" else build()
steps = run(engine) if mode == "main" else other.call(run, engine)
print(f"{mode}: batch-32 decode step, median of {len(steps)}: {1e3 * statistics.median(steps):.1f} ms")
