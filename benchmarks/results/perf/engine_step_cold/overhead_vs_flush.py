"""Engine overhead per decode step (batch 32, tiny default model) against what the step's forward
leaves in the caches: the real forward, or a stand-in that returns the same hidden states after
streaming N MB through the caches (0 = warm). Rounds alternate between the variants.

usage: python overhead_vs_flush.py ROUNDS OUT.json [MODEL]"""
import json, statistics, sys, time
import torch
from pdserve.engine.llm_engine import LLMEngine
from pdserve.benchmarks.roofline import engine_overhead

e = LLMEngine(sys.argv[3] if len(sys.argv) > 3 else "pdserve/data/default-model")
ids = list(range(5, 5 + 128))
model = e.runner.model
real_forward = model.forward
buf = torch.zeros(64 << 18)   # 64 MB of fp32
hidden = {}

def stand_in(mb):
    def forward(input_ids, positions):
        if mb:
            buf[:mb << 18].add_(1.0)   # read and write mb MB
        return hidden[input_ids.shape[0]]
    return forward

def capture(input_ids, positions):
    out = real_forward(input_ids, positions)
    hidden[input_ids.shape[0]] = out.clone()
    return out

model.forward = capture
engine_overhead(e, 32, 128, ids, steps=4)
variants = {"forward": real_forward, **{f"flush_{mb}MB": stand_in(mb) for mb in (0, 8, 16, 24, 32, 64)}}
res = {k: [] for k in variants}
for r in range(int(sys.argv[1])):
    for k, f in variants.items():
        model.forward = f
        o = engine_overhead(e, 32, 128, ids, steps=64)
        res[k].append(o["overhead_ms"])
model.forward = real_forward
summary = {k: {"median_overhead_ms": statistics.median(v), "rounds_ms": v} for k, v in res.items()}
for k, v in summary.items():
    print(f"{k:14s} {v['median_overhead_ms']:.3f} ms  " + " ".join(f"{x:.3f}" for x in v["rounds_ms"]))
json.dump({"batch": 32, "context": 128, "steps_per_round": 64, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "variants": summary}, open(sys.argv[2], "w"), indent=1)
