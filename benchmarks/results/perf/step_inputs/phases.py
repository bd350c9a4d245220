# Phases of batch-B decode steps on the tiny model (medians of 400), and the time in build_metadata.
# usage: phases.py B [stream]   (default: final-only requests)
import sys, time, statistics
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
import pdserve.layers.attention as att
import pdserve.engine.model_runner as mr
e = LLMEngine("pdserve/data/default-model")
ids = list(range(5, 5 + 128))
B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
final = (sys.argv[2] != "stream") if len(sys.argv) > 2 else True
T = {}
orig_bm = att.build_metadata
def bm(*a, **k):
    t = time.perf_counter(); r = orig_bm(*a, **k); T.setdefault("build_metadata", []).append(time.perf_counter() - t); return r
mr.build_metadata = bm
for rid in range(B):
    e.add_request(str(rid), ids, SamplingParams(max_tokens=700, temperature=0, ignore_eos=True, final_only=final))
while e.scheduler.waiting or any(s.is_prefill for s in e.scheduler.running):
    e.step()
for _ in range(5): e.step()
T.clear()
ph = {}
tot, fw = [], []
for _ in range(400):
    t = time.perf_counter(); e.step(); tot.append(time.perf_counter() - t)
    for k, v in e.last_step.phases.items(): ph.setdefault(k, []).append(v)
    fw.append(e.runner.last_forward_time)
med = lambda x: 1e6 * statistics.median(x)
print(f"B={B} final={final} step {med(tot):.0f} forward {med(fw):.0f} overhead(med diff) {med(tot)-med(fw):.0f} us")
print("  ".join(f"{k} {med(v):.1f}" for k, v in ph.items()), " build_metadata", f"{med(T['build_metadata']):.1f}")
