import time, statistics, torch, sys
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import cpu_ops
eng = LLMEngine("/work/q05")
mm = eng.runner.model
ops = cpu_ops()
mods = []
for l in mm.model.layers:
    mods += [l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj]
mods.append(mm.lm_head)
nbytes = sum(m.packed.numel() * m.packed.element_size() for m in mods)
Ms = [int(a) for a in sys.argv[1].split(",")]
res = {M: [] for M in Ms}
for r in range(8):
    for M in Ms:
        xs = [torch.randn(M, m.in_features) for m in mods]
        t = time.perf_counter()
        for m, x in zip(mods, xs): ops.packed_linear(x, m.packed, m.scale)
        res[M].append(time.perf_counter() - t)
for M in Ms:
    print(M, f"{statistics.median(res[M])*1e3:.2f} ms, {nbytes/statistics.median(res[M])/1e9:.1f} GB/s, ratio to M=1 {statistics.median(res[M])/statistics.median(res[Ms[0]]):.3f}")
