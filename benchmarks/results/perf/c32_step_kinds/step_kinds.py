# GFLOP/s of c32's step kinds (0.5B): prefill 4x128, mixed 32 decodes + 480 prefill tokens, pure decode 32; alternating.
import statistics, os
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import time_step, step_cost, ModelCost
e = LLMEngine("/work/q05")
mc = ModelCost.from_config(e.model_config, 4)
ids = list(range(1000, 1000 + 4096))
kinds = {"prefill512": [(128, 128)] * 4,
         "mixed": [(1, 200)] * 32 + [(128, 128)] * 3 + [(96, 96)],
         "prefill2048": [(128, 128)] * 16,
         "mixed2048": [(1, 200)] * 32 + [(128, 128)] * 15 + [(96, 96)],
         "decode32": [(1, 200)] * 32}
res = {k: [] for k in kinds}
for r in range(int(os.environ.get("ROUNDS", "3"))):
    for k, s in kinds.items():
        fw, _ = time_step(e, s, ids, 3)
        res[k].append(statistics.median(fw))
for k, s in kinds.items():
    rows = sum(1 for q, c in s if q == c or q == 1)  # logits rows: decodes and finishing prefills (96 one is a chunk end too)
    c = step_cost(mc, s, rows)
    t = statistics.median(res[k])
    fl = c.flops_linear + c.flops_attn + c.flops_lm_head
    print(f"{k}: {t*1e3:.1f} ms, {fl/1e9:.1f} GFLOP, {fl/t/1e9:.1f} GFLOP/s; lm_head {c.flops_lm_head/1e9:.1f} attn {c.flops_attn/1e9:.2f}", flush=True)
