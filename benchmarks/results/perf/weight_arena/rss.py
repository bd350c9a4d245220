# Resident memory of a process that has loaded the 0.5B engine (run from a checkout: PYTHONPATH=. python rss.py)
from pdserve.engine.llm_engine import LLMEngine
e = LLMEngine("/work/q05")
for line in open("/proc/self/status"):
    if line.startswith(("VmRSS", "VmSize")): print(line.strip())
print("AnonHugePages", open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split("\n")[0].strip())
