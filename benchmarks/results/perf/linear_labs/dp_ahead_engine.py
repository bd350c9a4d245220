# Lab (a kernel build with dp_ahead.patch applied, README.md): bf16, the 32-k-pair-step prefetch in micro_dp:
# VS 0 off, 1 at 2-3 row tiles (the fp32 rule), 2 at every tile count; alternating in one process.
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import cpu_ops
from alternating import run, variants
run(LLMEngine("/work/q05", dtype="bfloat16"), cpu_ops().set_dp_ahead, variants("0,1"), "8,12,16")
