"""Deferred detokenization of final-only requests on/off, alternating in one process (tiny, batch 32)."""
import statistics, sys, time
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.output_processor import OutputProcessor
from pdserve.sampling_params import SamplingParams
B, rounds, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
eng = LLMEngine("pdserve/data/default-model")
ids = list(range(100, 228))
p = SamplingParams(max_tokens=rounds * steps * 2 + 50, temperature=0, ignore_eos=True, final_only=True)
for i in range(B): eng.add_request(f"r{i}", ids, p)
while eng.scheduler.waiting or any(s.is_prefill for s in eng.scheduler.running): eng.step()
for _ in range(3): eng.step()
res = {True: [], False: []}; ratios = []
for r in range(rounds):
    per = {}
    for v in ((True, False) if r % 2 == 0 else (False, True)):
        for s in eng.scheduler.running:
            OutputProcessor.catch_up_text(s); s.defer_text = v
        ov = []
        for _ in range(steps):
            t0 = time.perf_counter(); eng.step(); t = time.perf_counter() - t0
            ov.append(t - eng.runner.last_forward_time)
        per[v] = statistics.median(ov); res[v].append(per[v])
    ratios.append(per[True] / per[False])
for v in (False, True):
    print(f"defer={v}: overhead {statistics.median(res[v])*1e3:.3f} ms")
print("on/off overhead per round", " ".join(f"{x:.3f}" for x in ratios), "median", f"{statistics.median(ratios):.3f}")
