"""c32 through the server: the engine with and without OMP thread binding (OMP_PROC_BIND=close,
OMP_PLACES=cores), one server per run, the order alternating by round. Usage: bind_ab.py ROUNDS."""
import json, os, subprocess, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))   # benchmarks/: servers.py
import servers
MODEL = "/work/q05"
VARIANTS = {"default": {}, "bind": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}}
rounds = int(sys.argv[1])
res = {}
for r in range(rounds):
    order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
    for v in order:
        port = servers.free_port()
        cmd = [sys.executable, "-m", "pdserve", "serve", "--model", MODEL, "--port", str(port), "--max-model-len", "4096",
               "--log-level", "warning"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", **VARIANTS[v])
        srv = servers.Server(v, cmd, port, os.path.join(HERE, f"{v}-{r}.log"), env=env)
        with srv.start(timeout=300):
            out = os.path.join(HERE, f"{v}-{r}.json")
            subprocess.run([sys.executable, "-m", "pdserve", "bench", "--base-url", srv.base_url, "--model", "q05",
                            "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128",
                            "--num-prompts", "64", "--max-concurrency", "32", "--seed", str(1000 + r), "--output", out,
                            "--disable-tqdm"], check=True, capture_output=True)
            d = json.load(open(out))
            tput = d.get("output_throughput") or d.get("output_tok_s")
            res.setdefault(v, []).append(tput)
            print(f"round {r} {v}: {tput:.1f} tok/s", flush=True)
print(res)
