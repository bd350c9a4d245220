import subprocess, time, statistics, sys, os, json, socket
import httpx
from pdserve import LLM, SamplingParams
port = 8771
srv = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model", "/work/q05", "--port", str(port), "--log-level", "warning"])
llm = LLM("/work/q05")
for _ in range(600):
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200: break
    except Exception: pass
    time.sleep(0.5)
ids = list(range(100, 228))
def server_itl():
    body = {"model": "q05", "prompt": ids, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line: times.append(time.perf_counter())
    d = [b - a for a, b in zip(times, times[1:])][5:]
    return statistics.median(d) * 1e3
def offline_step():
    eng = llm.engine
    eng.add_request("x", ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    st = []
    while eng.has_unfinished_requests():
        t = time.perf_counter(); eng.step(); st.append(time.perf_counter() - t)
    return statistics.median(st[6:]) * 1e3
server_itl(); offline_step()
for r in range(4):
    print(f"round {r}: server ITL {server_itl():.1f} ms, offline step {offline_step():.1f} ms", flush=True)
srv.terminate(); srv.wait()
