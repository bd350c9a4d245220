"""`python -m benchmarks.neighbour`: what a busy neighbour costs each server (issue 39).

A machine people serve from is rarely empty: a test suite, a browser, another tenant of the VM,
the benchmark client itself. On each system this starts the server once, warms it up, then runs
the c32 and c1 workloads of benchmarks/compare.py three times: on a quiet machine, and with one
and with two neighbour processes that each keep a core busy (`while True: pass`, at normal
priority). It reports each figure and its ratio to the same system's quiet one, side by side in
one run, and writes the table into docs/BENCHMARKS.md (section "Busy neighbours").

    python -m benchmarks.neighbour --model /path/to/qwen2-0.5b                 # pdserve variants
    python -m benchmarks.neighbour --model M --systems engine,engine-1t,vllm    # with vLLM's CPU build

Systems: `engine` (pdserve as it starts by default: its thread count adapts to the machine),
`engine-2t` (`--threads 2`, fixed: pdserve before it adapted), `engine-1t` (`--threads 1`),
`engine-passive` (OMP_WAIT_POLICY=PASSIVE), `engine-spin3k` and `engine-spin30k`
(GOMP_SPINCOUNT=3000, 30000), `vllm` (installed on first use,
benchmarks/peers.py). A run that exceeds its time limit is reported as such, never dropped.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime

from benchmarks import peers
from benchmarks.report_md import replace_block
from benchmarks.compare import bench_command, busy_cores, loadavg, machine_info, server_for, summary_metrics
from benchmarks.workloads import WORKLOADS, warmup_for
from pdserve.bench import servers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pdserve variants: (the compare.py system that starts it, extra serve flags, environment)
VARIANTS = {
    "engine": ("engine", [], {}),
    "engine-1t": ("engine", ["--threads", "1"], {}),
    "engine-2t": ("engine", ["--threads", "2"], {}),
    "engine-passive": ("engine", [], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "engine-spin3k": ("engine", [], {"GOMP_SPINCOUNT": "3000"}),
    "engine-spin30k": ("engine", [], {"GOMP_SPINCOUNT": "30000"}),
    "vllm": ("vllm", [], {}),
}


def say(msg: str) -> None:
    print(f"[neighbour {datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def start_neighbours(n: int) -> list[subprocess.Popen]:
    """n processes, each keeping one core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def make_server(variant: str, model: str, peers_dir: str, log_dir: str) -> servers.Server:
    system, flags, env = VARIANTS[variant]
    server = server_for(system, model, os.path.basename(os.path.normpath(model)), peers_dir, log_dir)
    server.name = variant
    server.cmd = server.cmd + flags
    server.env = dict(server.env or os.environ, **env)
    server.log_path = os.path.join(log_dir, f"{variant}.log")
    return server


def run_bench(server: servers.Server, name: str, wl, seed: int, out: str, timeout: float) -> dict:
    """One `pdserve bench` run; its summary metrics, or the reason there are none."""
    cmd = bench_command(server, name, wl, seed, out)
    if os.path.exists(out):
        os.remove(out)
    t0 = time.monotonic()
    try:
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                       timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"over {timeout:.0f} s"}
    if not os.path.exists(out):
        return {"status": "bench failed"}
    with open(out, encoding="utf-8") as f:
        res = json.load(f)
    return {"status": "ok" if not res.get("failed") else f"{res['failed']} failed",
            "metrics": summary_metrics(res), "bench_s": round(time.monotonic() - t0, 1)}


def run_variant(variant: str, args, workloads, seed: int) -> list[dict]:
    name = os.path.basename(os.path.normpath(args.model))
    log_dir = os.path.join(args.out_dir, "logs")
    records = []
    server = make_server(variant, args.model, args.peers_dir, log_dir)
    say(f"{variant}: starting ({' '.join(server.cmd[2:5])} ...)")
    try:
        server.start(timeout=args.start_timeout)
    except servers.PeerError as e:
        say(f"{variant}: failed to start: {str(e).splitlines()[0]}")
        return [dict(system=variant, neighbours=n, workload=wl.name, status="start failed")
                for n in args.neighbours for wl in workloads]
    try:
        run_bench(server, name, warmup_for("engine"), seed + 99, os.path.join(args.out_dir, "warmup.json"), 600)
        for n in args.neighbours:
            procs = start_neighbours(n)
            try:
                time.sleep(1.0)   # the neighbours are running before the first request
                for wl in workloads:
                    seed += 1     # fresh prompts: vLLM caches prefixes
                    out = os.path.join(args.out_dir, f"{variant}-n{n}-{wl.name}.json")
                    r = run_bench(server, name, wl, seed, out, args.timeout)
                    r.update(system=variant, neighbours=n, workload=wl.name, loadavg=loadavg())
                    m = r.get("metrics", {})
                    say(f"{variant}, {n} busy: {wl.name}: {r['status']}"
                        + (f", {m['output_throughput']:.1f} tok/s, TPOT {m['mean_tpot_ms']:.1f} ms" if m else ""))
                    records.append(r)
            finally:
                stop(procs)
    finally:
        server.stop()
    return records


def table(records: list[dict], variants: list[str], neighbours: list[int]) -> str:
    """c32 output tok/s and c1 mean TPOT per system and neighbour count, with ratios to quiet."""
    def get(v, n, wl, key):
        for r in records:
            if r["system"] == v and r["neighbours"] == n and r["workload"] == wl:
                return r.get("metrics", {}).get(key), r["status"]
        return None, "not run"

    head = ["system"] + [f"c32 tok/s, {n} busy" for n in neighbours] + [f"c1 TPOT ms, {n} busy" for n in neighbours]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        row = [v]
        for wl, key, better in (("c32", "output_throughput", "higher"), ("c1", "mean_tpot_ms", "lower")):
            quiet, _ = get(v, neighbours[0], wl, key)
            for n in neighbours:
                val, status = get(v, n, wl, key)
                if val is None:
                    row.append(status)
                elif n == neighbours[0] or not quiet:
                    row.append(f"{val:.1f}")
                else:
                    row.append(f"{val:.1f} ({val / quiet:.2f}x)")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_doc(path: str, text: str) -> None:
    replace_block(path, "neighbour", "## Busy neighbours", text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. the 0.5B one of tools.make_model)")
    p.add_argument("--systems", default="engine,engine-2t,engine-1t",
                   help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--neighbours", default="0,1,2", help="busy neighbour processes per run, comma-separated")
    p.add_argument("--workloads", default="c32,c1")
    p.add_argument("--size", default="0.5b", choices=["tiny", "0.5b", "quick"], help="compare.py's workload sizes")
    p.add_argument("--timeout", type=float, default=900, help="seconds one bench run may take")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--peers-dir", default=peers.DEFAULT_PEERS_DIR)
    p.add_argument("--out-dir", default="/tmp/pdserve-neighbour")
    p.add_argument("--doc", default=None, help="write the table into this markdown file (docs/BENCHMARKS.md)")
    p.add_argument("--seed", type=int, default=7000)
    args = p.parse_args(argv)
    variants = [v for v in args.systems.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown system {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    args.neighbours = [int(n) for n in args.neighbours.split(",")]
    workloads = [wl for wl in WORKLOADS[args.size] if wl.name in args.workloads.split(",")]
    os.makedirs(args.out_dir, exist_ok=True)
    busy = busy_cores()
    say(f"other work keeps {busy} of {os.cpu_count()} cores busy before the first run")
    records = []
    for i, v in enumerate(variants):
        records += run_variant(v, args, workloads, args.seed + 1000 * i)
    info = machine_info()
    text = (f"{datetime.now():%Y-%m-%d}, {info.get('model name', '?')}, {info.get('cores')} cores"
            f" (AVX-512: {'yes' if info.get('avx512') else 'no'}); `{os.path.basename(os.path.normpath(args.model))}`;"
            f" other work kept {busy} cores busy before the run. Ratios are to the same system's quiet figure.\n"
            f"`python -m benchmarks.neighbour --model M --systems {','.join(variants)}`\n\n"
            + table(records, variants, args.neighbours))
    print(text)
    with open(os.path.join(args.out_dir, "neighbour.json"), "w", encoding="utf-8") as f:
        json.dump({"machine": info, "busy_cores_before": busy, "records": records}, f, indent=1)
    if args.doc:
        write_doc(args.doc, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
