# Lab (a kernel build with cross_call_prefetch.patch applied, README.md): the next linear's first weights prefetched
# at the end of each thread's share, at several budgets (VS: bytes per thread:hint, 0 = off), alternating in one process.
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import cpu_ops
from alternating import run, variants
run(LLMEngine("/work/q05"), cpu_ops().set_xpf, variants("0:2,131072:2,524288:2"), "1,4,16,32")
