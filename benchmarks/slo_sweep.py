"""SLO sweep: the highest request rate at which >= 90% of requests meet both their objectives,
per scheduling policy (issue 28).

The workload is mixed: interactive requests (short prompts, tight TTFT and TPOT targets,
priority 0) among long-document ones (long prompts, loose targets, priority 1), arriving as a
Poisson process. For each policy, start `pdserve serve --scheduling-policy POLICY`, send the same
requests (one seed) at each rate with `pdserve bench --slo-mix ...`, and read the share of
requests that met both of their own targets (slo_attainment; refused and failed ones are misses).
The answer per policy is the highest swept rate whose attainment is >= --target, and that rate
times the attainment is the goodput there. Each bench result goes to RESULTS/slo/<policy>-<rate>.json
(`pdserve report RESULTS/slo/*.json` plots them), the summary to RESULTS/slo.json, a table to stdout.

    python -m benchmarks.slo_sweep --quick                 # tiny model, 2 policies, 3 rates (~2 min)
    python -m benchmarks.slo_sweep                         # the bundled tiny model, every policy
    python -m benchmarks.slo_sweep --model /work/q05 --short 2000:150 --long 60000:1000 --rates 0.25,0.5,1,2
    python -m benchmarks.slo_sweep --dry-run               # the commands only
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

from pdserve.bench import servers
from pdserve.engine.args import DEFAULT_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("fcfs", "priority", "slo")
PEERS = ("vllm",)   # at its defaults: it gets the same requests, priority 0 (its fcfs refuses others)
SEED = 2800


def max_rate_at(rows: list[dict], target: float) -> dict | None:
    """The row of the highest rate whose attainment is >= target (None if no rate reaches it)."""
    good = [r for r in rows if r.get("slo_attainment") is not None and r["slo_attainment"] >= target]
    return max(good, key=lambda r: r["rate"]) if good else None


def summarize(policy: str, res: dict, rate: float) -> dict:
    keys = ("slo_attainment", "slo_ttft_attainment", "slo_tpot_attainment", "slo_goodput", "request_throughput",
            "output_throughput", "short_slo_attainment", "long_slo_attainment", "short_p99_ttft_ms",
            "short_p99_tpot_ms", "completed", "failed")
    return {"policy": policy, "rate": rate, **{k: res.get(k) for k in keys}}


def table(rows: list[dict], target: float) -> str:
    lines = [f"{'policy':<10} {'rate':>6} {'attain':>7} {'ttft':>6} {'tpot':>6} {'short':>6} {'long':>6} "
             f"{'goodput':>8} {'req/s':>6} {'failed':>6}"]
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"   # noqa: E731
    for r in rows:
        lines.append(f"{r['policy']:<10} {r['rate']:>6g} {pct(r['slo_attainment']):>7} "
                     f"{pct(r['slo_ttft_attainment']):>6} {pct(r['slo_tpot_attainment']):>6} "
                     f"{pct(r['short_slo_attainment']):>6} {pct(r['long_slo_attainment']):>6} "
                     f"{r['slo_goodput'] or 0:>8.2f} {r['request_throughput'] or 0:>6.2f} {r['failed'] or 0:>6}")
    lines.append("")
    for policy in dict.fromkeys(r["policy"] for r in rows):
        best = max_rate_at([r for r in rows if r["policy"] == policy], target)
        lines.append(f"{policy}: " + ("no swept rate reaches the target" if best is None else
                                      f"highest rate with >= {target:.0%} attainment: {best['rate']:g} req/s "
                                      f"(goodput {best['slo_goodput']:.2f} req/s)"))
    return "\n".join(lines)


def parse_targets(text: str) -> tuple[float, float]:
    ttft, _, tpot = text.partition(":")
    return float(ttft), float(tpot)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.slo_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated pdserve policies, and `vllm` for vLLM's CPU build (default: %(default)s)")
    p.add_argument("--peers-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "pdserve-peers"))
    p.add_argument("--rates", default="1,2,4,8", help="request rates to sweep, req/s (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--short-len", type=int, default=64, help="interactive prompt tokens (default: %(default)s)")
    p.add_argument("--long-len", type=int, default=768, help="long-document prompt tokens (default: %(default)s)")
    p.add_argument("--long-fraction", type=float, default=0.25)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--short", default="1000:60", metavar="TTFT_MS:TPOT_MS",
                   help="interactive targets (default: %(default)s)")
    p.add_argument("--long", default="20000:400", metavar="TTFT_MS:TPOT_MS",
                   help="long-document targets (default: %(default)s)")
    p.add_argument("--target", type=float, default=0.9, help="attainment to reach (default: %(default)s)")
    p.add_argument("--server-args", default="", help="extra `pdserve serve` flags, one string")
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--quick", action="store_true", help="fcfs and slo, rates 2,4,8, 24 requests")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.policies, args.rates, args.num_prompts = "fcfs,slo", "2,4,8", 24
    args.policies = args.policies.split(",")
    args.rates = sorted(float(r) for r in args.rates.split(","))
    bad = [x for x in args.policies if x not in POLICIES + PEERS]
    if bad:
        p.error(f"--policies: unknown {bad}; choose from {POLICIES + PEERS}")
    return args


def server_for(policy: str, args, log_dir: str) -> servers.Server:
    if policy in PEERS:
        from benchmarks import compare
        name = os.path.basename(os.path.normpath(args.model))
        return compare.server_for(policy, args.model, name, args.peers_dir, log_dir, args.dry_run)
    port = servers.free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", args.model, "--port", str(port),
           "--scheduling-policy", policy, "--log-level", "warning", *args.server_args.split()]
    return servers.Server(f"engine-{policy}", cmd, port, os.path.join(log_dir, f"engine-{policy}.log"))


def bench_command(server: servers.Server, policy: str, rate: float, args, out: str | None, seed: int = SEED,
                  num_prompts: int | None = None) -> list[str]:
    (st, sp), (lt, lp) = parse_targets(args.short), parse_targets(args.long)
    short_p, long_p = ("", "") if policy in PEERS else (":0", ":1")
    return [sys.executable, "-m", "pdserve", "bench", "--base-url", server.base_url, "--dataset-name", "long-short",
            "--random-input-len", str(args.short_len), "--long-input-len", str(args.long_len),
            "--long-fraction", str(args.long_fraction), "--random-output-len", str(args.output_len),
            "--num-prompts", str(num_prompts or args.num_prompts), "--request-rate", str(rate), "--seed", str(seed),
            "--slo-mix", f"short:{st:g}:{sp:g}{short_p}", f"long:{lt:g}:{lp:g}{long_p}", "--label", policy,
            "--disable-tqdm", *(["--output", out] if out else [])]


def rate_seed(k: int) -> int:
    """The k-th rate's prompts: the same for every system, new at each rate. Every server caches
    prefixes (pdserve's cache is on by default): a rate that resent an earlier rate's prompts
    would measure cache hits, not scheduling."""
    return SEED + 100 * (k + 1)


def run_policy(policy: str, args, out_dir: str, log_dir: str) -> list[dict]:
    server = server_for(policy, args, log_dir)
    if args.dry_run:
        print(" ".join(server.cmd))
        for k, rate in enumerate(args.rates):
            print("  " + " ".join(bench_command(server, policy, rate, args, "OUT.json", rate_seed(k))))
        return []
    rows = []
    with server.start(timeout=900):
        # warm-up: other prompts (another seed), all at once
        subprocess.run(bench_command(server, policy, float("inf"), args, None, SEED + 1, 8),
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=600)
        for k, rate in enumerate(args.rates):
            out = os.path.join(out_dir, f"{policy}-{rate:g}.json")
            t0 = time.monotonic()
            with open(os.path.join(log_dir, f"bench-{policy}-{rate:g}.log"), "w") as log:
                rc = subprocess.run(bench_command(server, policy, rate, args, out, rate_seed(k)), stdout=log,
                                    stderr=subprocess.STDOUT, timeout=1200).returncode
            if rc not in (0, 1) or not os.path.exists(out):
                print(f"{policy} at {rate:g} req/s: pdserve bench exit {rc}", flush=True)
                continue
            with open(out) as f:
                row = summarize(policy, json.load(f), rate)
            rows.append(row)
            print(f"{policy} at {rate:g} req/s: attainment {row['slo_attainment']:.0%} "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = os.path.join(args.results, "slo")
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    rows = [row for policy in args.policies for row in run_policy(policy, args, out_dir, log_dir)]
    if args.dry_run:
        return 0
    summary = {"model": args.model, "target": args.target, "short": args.short, "long": args.long,
               "workload": {k: getattr(args, k) for k in ("num_prompts", "short_len", "long_len", "long_fraction",
                                                           "output_len")},
               "rows": rows, "best": {p: max_rate_at([r for r in rows if r["policy"] == p], args.target)
                                      for p in args.policies}}
    with open(os.path.join(args.results, "slo.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(table(rows, args.target))
    from pdserve.bench.report import load_results, plot_attainment_vs_rate
    files = sorted(glob.glob(os.path.join(out_dir, "*.json")))
    named = [(os.path.basename(p), r) for p in files for r in load_results(p)]
    plot = plot_attainment_vs_rate(named, args.results)
    if plot:
        print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
