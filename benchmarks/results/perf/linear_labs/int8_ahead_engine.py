# Lab (a /tmp build with a settable int8 prefetch, set_i8_pf(mode, distance); int8_ahead.patch is the version tried
# for main): int8, a prefetch DIST k-steps ahead in the int8 tile (one line per 4 k-steps) at every tile count,
# VS mode:distance (0 off), alternating in one process.
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import cpu_ops
from alternating import run, variants
run(LLMEngine("/work/q05", quantization="int8"), cpu_ops().set_i8_pf, variants("0:128,1:128"), "1,4,6,12,16,24,32")
