# Lab (a kernel build with work_stealing.patch applied, README.md): fp32, threads that finish their half of
# a linear's channel groups take the other's last groups. VS 1 stealing, 0 the static halves; alternating in one process.
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import cpu_ops
from alternating import run, variants
run(LLMEngine("/work/q05", max_model_len=4096), cpu_ops().set_steal, variants("1,0"), "1,4,32")
