# streaming rate of each kind of weight read at batch 1, cold (1 GiB read and written between kinds), and a read probe
import os, sys, time, statistics, torch
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import cpu_ops
from pdserve.benchmarks import machine_limits
e = LLMEngine("/work/q05")
mm = e.runner.model
ops = cpu_ops()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "linear_labs"))
from model_linears import layer_linears   # the labs' shared setup: qkv, o, gate_up, down per layer
mods = layer_linears(mm)
kinds = {name: mods[i::4] for i, name in enumerate(("qkv", "o", "gate_up", "down"))}
head = mm.lm_head
flush = torch.empty(256 << 20, dtype=torch.float32)
probe = machine_limits.probe_array(1 << 30)
res = {k: [] for k in list(kinds) + ["lm_head screened", "lm_head fp32", "probe"]}
for r in range(6):
    for k, mods in kinds.items():
        flush.add_(1)
        xs = [torch.randn(1, m.in_features) for m in mods]
        t = time.perf_counter()
        for m, x in zip(mods, xs): ops.packed_linear(x, m.packed, m.scale)
        res[k].append(sum(m.packed.numel() * 4 for m in mods) / (time.perf_counter() - t) / 1e9)
    for k in ("lm_head screened", "lm_head fp32"):
        flush.add_(1)
        x = torch.randn(1, head.in_features)
        head.use_screen = k == "lm_head screened"
        t = time.perf_counter()
        head.argmax(x)
        dt = time.perf_counter() - t
        nbytes = head.screen.numel() * 2 if head.use_screen else head.packed.numel() * 4
        res[k].append(nbytes / dt / 1e9)
    head.use_screen = True
    t = time.perf_counter(); probe.sum(); res["probe"].append(probe.numel() * probe.element_size() / (time.perf_counter() - t) / 1e9)
for k, v in res.items():
    print(f"{k:18s} {statistics.median(v):5.1f} GB/s  rounds {' '.join(f'{x:.0f}' for x in v)}")
