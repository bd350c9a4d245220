"""Fused argmax on/off alternating in one process: whole engine.step() and its overhead (step - forward)."""
import statistics, sys, time
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
model, B, final = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "final"
rounds, steps = int(sys.argv[4]), int(sys.argv[5])
eng = LLMEngine(model, max_model_len=2048)
ids = list(range(100, 100 + int(sys.argv[6]) if len(sys.argv) > 6 else 228))
p = SamplingParams(max_tokens=rounds * steps * 2 + 50, temperature=0, ignore_eos=True, final_only=final)
for i in range(B): eng.add_request(f"r{i}", ids, p)
while eng.scheduler.waiting or any(s.is_prefill for s in eng.scheduler.running): eng.step()
for _ in range(3): eng.step()
res = {True: ([], []), False: ([], [])}
ratios_step, ratios_ovh = [], []
for r in range(rounds):
    per = {}
    for v in ((True, False) if r % 2 == 0 else (False, True)):
        eng.runner.fused_argmax = v
        st, ov = [], []
        for _ in range(steps):
            t0 = time.perf_counter(); eng.step(); t = time.perf_counter() - t0
            st.append(t); ov.append(t - eng.runner.last_forward_time)
        per[v] = (statistics.median(st), statistics.median(ov))
        res[v][0].append(per[v][0]); res[v][1].append(per[v][1])
    ratios_step.append(per[True][0] / per[False][0]); ratios_ovh.append(per[True][1] / per[False][1])
for v in (False, True):
    print(f"fused={v}: step {statistics.median(res[v][0])*1e3:.3f} ms, overhead {statistics.median(res[v][1])*1e3:.3f} ms")
print("on/off step per round", " ".join(f"{x:.3f}" for x in ratios_step), "median", f"{statistics.median(ratios_step):.3f}")
print("on/off overhead per round", " ".join(f"{x:.3f}" for x in ratios_ovh), "median", f"{statistics.median(ratios_ovh):.3f}")
