# ATen ops run in 10 decode steps of B requests (torch.profiler, CPU): the glue between the stack's kernels.
# usage: aten_ops.py MODEL B   (from the repository root)
import sys, torch
sys.path.insert(0, "benchmarks/results/perf")
from step_ab import decoding_engine
from torch.profiler import profile, ProfilerActivity
model = sys.argv[1]; B = int(sys.argv[2])
e = decoding_engine(model, B, True, 2, 30)
for _ in range(3): e.step()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(10): e.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=40))
