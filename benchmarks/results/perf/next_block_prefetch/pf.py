import sys, statistics, os, time
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams
import pdserve; print("code", os.path.dirname(pdserve.__file__), flush=True)
llm = LLM("/work/q05")
eng = llm.engine
p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
res = {}
for r in range(3):
    for n in (512, 2048):
        eng.add_request(f"p{r}-{n}", list(range(2000, 2000 + n)), p)
        while eng.has_unfinished_requests():
            eng.step()
            if eng.last_step.num_prefill_tokens: res.setdefault(n, []).append(eng.last_step.forward_time / eng.last_step.num_prefill_tokens)
for n, v in res.items(): print(f"prefill chunks of {n}-token prompt: median {statistics.median(v)*1e3:.3f} ms/token over {len(v)} steps", flush=True)
