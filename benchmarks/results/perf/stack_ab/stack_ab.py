import time, statistics, sys, torch
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
model = sys.argv[1]; B = int(sys.argv[2]); rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
eng = LLMEngine(model, dtype=sys.argv[5] if len(sys.argv) > 5 else "auto")
mm = eng.runner.model.model; m = mm.decoder if hasattr(mm, "decoder") else mm; stack = m.stack
ids = list(range(10, 200))
params = SamplingParams(max_tokens=int(sys.argv[4]) if len(sys.argv) > 4 else 2000, temperature=0, ignore_eos=True)
for i in range(B): eng.add_request(f"p{i}", ids[:128], params)
while eng.scheduler.waiting or any(s.is_prefill for s in eng.scheduler.running): eng.step()
for _ in range(3): eng.step()
res = {"modules": [], "stack": [], "modules_step": [], "stack_step": []}
for r in range(rounds):
    for mode in ("modules", "stack"):
        m.stack = stack if mode == "stack" else None
        for _ in range(5):
            t = time.perf_counter(); eng.step(); st = time.perf_counter() - t
            res[mode].append(eng.runner.last_forward_time * 1e3); res[mode + "_step"].append(st * 1e3)
med = {k: round(statistics.median(v), 3) for k, v in res.items()}
print(B, med, "forward ratio modules/stack", round(med["modules"] / med["stack"], 3))
