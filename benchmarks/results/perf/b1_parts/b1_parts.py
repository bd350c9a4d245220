# batch-1 decode step of the 0.5B model against its linears alone (same kernels, same order, x
# random), alternating in one process: what the step spends outside the weight stream
import os, sys, time, statistics, torch
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.kernels import cpu_ops
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "linear_labs"))
from model_linears import layer_linears   # the labs' shared setup
e = LLMEngine("/work/q05")
mm = e.runner.model
ops = cpu_ops()
mods = layer_linears(mm)
head = mm.lm_head
e.add_request("a", list(range(5, 133)), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, final_only=True))
while e.scheduler.waiting or any(s.is_prefill for s in e.scheduler.running):
    e.step()
step_t, fw_t, lin_t = [], [], []
for r in range(12):
    for _ in range(3):
        t = time.perf_counter(); e.step(); step_t.append(time.perf_counter() - t); fw_t.append(e.runner.last_forward_time)
    for _ in range(3):
        xs = [torch.randn(1, m.in_features) for m in mods]
        xh = torch.randn(1, head.in_features)
        t = time.perf_counter()
        with torch.inference_mode():
            for m, x in zip(mods, xs): ops.packed_linear(x, m.packed, m.scale)
            head.argmax(xh)
        lin_t.append(time.perf_counter() - t)
s, f, l = (statistics.median(v) * 1e3 for v in (step_t, fw_t, lin_t))
print(f"step {s:.2f} ms, forward {f:.2f}, linears + screened lm_head alone {l:.2f}: the rest of the forward {f - l:.2f} ms ({100 * (f - l) / f:.1f}%)")
