"""Colocated against disaggregated serving on the same cores (issue 29).

Two systems on the same two cores: `colocated`, one engine with both cores (`pdserve serve
--threads 2`, pinned to them), and `disaggregated`, `pdserve serve --disaggregate` with one
prefill core and one decode core (the proxy on the launcher, unpinned). Each runs, with the same
prompts (one seed), two `pdserve bench` workloads:

- long-short: compare.py's head-of-line workload (a few long prompts among short ones, all sent
  at once under a concurrency cap), where a long prefill in a colocated step stalls every decode;
- slo: the same mix arriving as a Poisson process at --rate, judged with `--goodput` against
  per-phase targets (--slo TTFT_MS:TPOT_MS).

From each: the short requests' p99 and median ITL, their mean and p99 TTFT, output tok/s, and
goodput (requests meeting both targets per second). From the engines' step logs: the decode
step time against the prefill tokens computed at the same time, in the same step (colocated), or
on the prefill worker while the decode worker stepped (disaggregated): the interference that
disaggregation removes, and what it costs.

    python -m benchmarks.disagg --quick                          # the bundled tiny model, small runs (~3 min)
    python -m benchmarks.disagg --model /work/q05                # the 0.5B model
    python -m benchmarks.disagg --model /work/q05 --plot docs/benchmarks/disagg-steps.png
    python -m benchmarks.disagg --dry-run                        # the commands only

Results go to RESULTS/disagg/<system>-<workload>.json (`pdserve report` reads them), the
summary to RESULTS/disagg.json, a table to stdout.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np

from benchmarks import compare
from benchmarks.workloads import WARMUP, WORKLOADS, Workload
from pdserve.bench import servers
from pdserve.bench.report import latency_samples, load_step_log
from pdserve.engine.args import DEFAULT_MODEL
from pdserve.proxy.cores import format_cores, parse_cores

REPO = compare.REPO
SYSTEMS = ("colocated", "disaggregated")
SEED = 2900
# prefill tokens computed alongside a decode step: the bins of the step-time table and plot
BINS = (0, 1, 33, 129, 257, 513)


def bin_label(i: int) -> str:
    lo = BINS[i]
    if i + 1 == len(BINS):
        return f">={lo}"
    hi = BINS[i + 1] - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


# ---------------------------------------------------------------- step logs

def read_steps(path: str) -> list[dict]:
    """A server's --step-log (pdserve report's reader); none if the server wrote no log."""
    return load_step_log(path) if os.path.exists(path) else []


def colocated_points(steps: list[dict]) -> list[tuple[int, float]]:
    """(prefill tokens in the step, step seconds) of each step that decodes."""
    return [(s["num_prefill_tokens"], s["duration"]) for s in steps if s["num_decode_tokens"]]


def disaggregated_points(decode_steps: list[dict], prefill_steps: list[dict]) -> list[tuple[int, float]]:
    """(prefill tokens of the prefill worker's step running at the decode step's midpoint, 0 if
    none, decode step seconds) of each decode worker step that decodes. The step logs' start
    times are time.perf_counter(), one monotonic clock for every process on the machine."""
    pre = sorted((s["start_time"], s["start_time"] + s["duration"], s["num_prefill_tokens"]) for s in prefill_steps)
    starts = [p[0] for p in pre]
    points = []
    for s in decode_steps:
        if not s["num_decode_tokens"]:
            continue
        mid = s["start_time"] + s["duration"] / 2
        i = bisect.bisect_right(starts, mid) - 1
        concurrent = pre[i][2] if i >= 0 and pre[i][1] >= mid else 0
        points.append((concurrent, s["duration"]))
    return points


def step_table(points: list[tuple[int, float]]) -> list[dict]:
    """Per bin of concurrent prefill tokens: how many decode steps, their median and p90 (ms)."""
    rows = []
    for i in range(len(BINS)):
        hi = BINS[i + 1] if i + 1 < len(BINS) else float("inf")
        ys = [d * 1e3 for x, d in points if BINS[i] <= x < hi]
        rows.append({"prefill_tokens": bin_label(i), "steps": len(ys),
                     "median_ms": float(np.median(ys)) if ys else None,
                     "p90_ms": float(np.percentile(ys, 90)) if ys else None})
    return rows


# ---------------------------------------------------------------- bench results

def _pct(values, q):
    return float(np.percentile(values, q)) if values else None


def summarize(res: dict) -> dict:
    """The comparison's numbers from one `pdserve bench --output` result (times in ms)."""
    short = latency_samples(res, "short") or {"itl": [], "ttft": []}
    return {"completed": res.get("completed"), "failed": res.get("failed"),
            "short_median_itl_ms": _pct(short["itl"], 50), "short_p99_itl_ms": _pct(short["itl"], 99),
            "short_mean_ttft_ms": float(np.mean(short["ttft"])) if short["ttft"] else None,
            "short_p99_ttft_ms": _pct(short["ttft"], 99), "long_mean_ttft_ms": res.get("long_mean_ttft_ms"),
            "output_throughput": res.get("output_throughput"), "request_goodput": res.get("request_goodput"),
            "request_throughput": res.get("request_throughput")}


# ---------------------------------------------------------------- servers and runs

def server_for(system: str, args, log_dir: str) -> servers.Server:
    port = servers.free_port()
    steps = os.path.join(log_dir, f"steps-{system}.jsonl")
    common = [sys.executable, "-m", "pdserve", "serve", "--model", args.model, "--port", str(port),
              "--log-level", "warning", "--step-log", steps, *args.server_args.split()]
    if system == "colocated":   # one engine on both cores
        cores = sorted(set(args.prefill_cores) | set(args.decode_cores))
        cmd = ["taskset", "-c", format_cores(cores), *common, "--threads", str(len(cores))]
    else:
        cmd = [*common, "--disaggregate", "--prefill-cores", format_cores(args.prefill_cores),
               "--decode-cores", format_cores(args.decode_cores)]
    return servers.Server(system, cmd, port, os.path.join(log_dir, f"{system}.log"))


def workloads(args) -> list[tuple[Workload, list[str]]]:
    """(workload, extra bench flags): long-short as compare.py runs it, and the SLO run."""
    key = "quick" if args.quick else args.workload
    ls = next(w for w in WORKLOADS[key] if w.name == "long-short")
    if args.num_prompts:
        ls = replace(ls, num_prompts=args.num_prompts)
    ttft, _, tpot = args.slo.partition(":")
    slo = replace(ls, name="slo", concurrency=0)
    slo_flags = ["--request-rate", str(args.rate), "--goodput", f"ttft:{ttft}", f"tpot:{tpot}"]
    return [(ls, []), (slo, slo_flags)]


def bench_command(server: servers.Server, wl: Workload, extra: list[str], out: str | None, seed: int) -> list[str]:
    args = wl.bench_args()
    if not wl.concurrency:   # an open-loop run: no cap
        i = args.index("--max-concurrency")
        del args[i:i + 2]
    return [sys.executable, "-m", "pdserve", "bench", "--base-url", server.base_url, *args, *extra,
            "--seed", str(seed), "--label", f"{server.name}-{wl.name}", "--disable-tqdm",
            *(["--output", out] if out else [])]


def run_system(system: str, args, log_dir: str) -> dict:
    server = server_for(system, args, log_dir)
    record = {"system": system, "server_cmd": server.cmd, "runs": []}
    plan = workloads(args)
    if args.dry_run:
        record["runs"] = [{"workload": wl.name, "bench_cmd": bench_command(server, wl, extra, "OUT.json", SEED)}
                          for wl, extra in plan]
        return record
    say(f"{system}: starting")
    try:
        server.start(timeout=args.start_timeout)
    except servers.PeerError as e:
        return {**record, "status": "start failed", "error": str(e)}
    try:
        record["ready_s"] = round(server.ready_s, 1)
        warm = bench_command(server, WARMUP, [], None, SEED + 50)
        subprocess.run(warm, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=args.bench_timeout)
        for wl, extra in plan:
            out = os.path.join(args.results, "disagg", f"{system}-{wl.name}.json")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            if os.path.exists(out):
                os.remove(out)
            cmd = bench_command(server, wl, extra, out, SEED)
            run = {"workload": wl.name, "bench_cmd": cmd, "describe": wl.describe()}
            t0 = time.monotonic()
            blog = os.path.join(log_dir, f"bench-{system}-{wl.name}.log")
            with open(blog, "w", encoding="utf-8") as f:
                try:
                    subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.bench_timeout)
                except subprocess.TimeoutExpired:
                    f.write("\nbench timed out\n")
            run["bench_s"] = round(time.monotonic() - t0, 1)
            if os.path.exists(out):
                with open(out, encoding="utf-8") as f:
                    run["metrics"] = summarize(json.load(f))
                run["json"] = os.path.relpath(out, REPO)
            else:
                run["error"] = servers.log_tail(blog, 8)
            say(f"{system} {wl.name}: {'done' if 'metrics' in run else 'failed'} in {run['bench_s']:.0f} s")
            record["runs"].append(run)
    finally:
        server.stop()
    steps = os.path.join(log_dir, f"steps-{system}.jsonl")
    if system == "colocated":
        points = colocated_points(read_steps(steps))
    else:
        root, ext = os.path.splitext(steps)
        points = disaggregated_points(read_steps(f"{root}.decode{ext}"), read_steps(f"{root}.prefill{ext}"))
    record.update(status="ok" if all("metrics" in r for r in record["runs"]) else "some failed",
                  step_points=points, step_table=step_table(points))
    return record


# ---------------------------------------------------------------- output

def fmt(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(records: list[dict]) -> str:
    lines = [f"{'system':<14} {'workload':<11} {'short ITL p50':>13} {'p99':>7} {'short TTFT':>10} {'p99':>7} "
             f"{'out tok/s':>9} {'goodput':>8} {'failed':>6}"]
    for rec in records:
        for run in rec.get("runs", []):
            m = run.get("metrics")
            if m is None:
                lines.append(f"{rec['system']:<14} {run['workload']:<11} {run.get('error', 'not run')[:60]}")
                continue
            lines.append(f"{rec['system']:<14} {run['workload']:<11} {fmt(m['short_median_itl_ms']):>13} "
                         f"{fmt(m['short_p99_itl_ms']):>7} {fmt(m['short_mean_ttft_ms']):>10} "
                         f"{fmt(m['short_p99_ttft_ms']):>7} {fmt(m['output_throughput']):>9} "
                         f"{fmt(m['request_goodput'], 2):>8} {m['failed'] or 0:>6}")
    lines += ["", "decode step time (ms, median / p90) by prefill tokens computed at the same time:",
              f"{'prefill tokens':<15}" + "".join(f"{r['system']:>26}" for r in records)]
    for i in range(len(BINS)):
        cells = []
        for rec in records:
            row = (rec.get("step_table") or [{}] * len(BINS))[i]
            cells.append(f"{fmt(row.get('median_ms'), 2)} / {fmt(row.get('p90_ms'), 2)} ({row.get('steps', 0)})")
        lines.append(f"{bin_label(i):<15}" + "".join(f"{c:>26}" for c in cells))
    return "\n".join(lines)


def plot(records: list[dict], path: str, title: str) -> str | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for rec, color in zip(records, ("tab:red", "tab:blue")):
        pts = rec.get("step_points") or []
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.scatter(xs, [y * 1e3 for y in ys], s=4, alpha=0.25, color=color)
        mids = [(r, i) for i, r in enumerate(rec["step_table"]) if r["median_ms"] is not None]
        centers = [np.median([x for x, _ in pts if BINS[i] <= x < (BINS[i + 1] if i + 1 < len(BINS) else 1e18)])
                   for _, i in mids]
        ax.plot(centers, [r["median_ms"] for r, _ in mids], marker="o", color=color, label=f"{rec['system']} (median)")
    ax.set_xlabel("prefill tokens computed during the decode step (same step, or on the prefill worker)")
    ax.set_ylabel("decode step time (ms)")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def say(msg: str) -> None:
    print(f"[disagg {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.disagg", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--workload", choices=("tiny", "0.5b"), default="tiny",
                   help="compare.py's long-short sizes for this model (default: %(default)s)")
    p.add_argument("--prefill-cores", type=parse_cores, default=None, help="(default: the first allowed core)")
    p.add_argument("--decode-cores", type=parse_cores, default=None, help="(default: the second)")
    p.add_argument("--rate", type=float, default=2.0, help="slo workload: requests per second (default: %(default)s)")
    p.add_argument("--slo", default="1000:100", metavar="TTFT_MS:TPOT_MS",
                   help="slo workload: the goodput targets (default: %(default)s)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated (default: %(default)s)")
    p.add_argument("--server-args", default="", help="extra `pdserve serve` flags for every server, one string")
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--plot", default=None, metavar="PNG", help="the step-time plot (default: RESULTS/disagg.png)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--bench-timeout", type=float, default=1200.0)
    p.add_argument("--num-prompts", type=int, default=None, help="requests per workload (default: compare.py's)")
    p.add_argument("--quick", action="store_true", help="compare.py's quick long-short sizes")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    args.systems = args.systems.split(",")
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        p.error(f"--systems: unknown {bad}; choose from {SYSTEMS}")
    allowed = sorted(os.sched_getaffinity(0))
    if args.prefill_cores is None or args.decode_cores is None:
        if len(allowed) < 2:
            p.error("needs two cores (this process may use one)")
        args.prefill_cores = args.prefill_cores or [allowed[0]]
        args.decode_cores = args.decode_cores or [c for c in allowed if c not in args.prefill_cores][:1]
    if set(args.prefill_cores) & set(args.decode_cores):
        p.error("--prefill-cores and --decode-cores must not share cores")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwind, so the running server is stopped
    started = time.strftime("%Y%m%d-%H%M%S")
    log_dir = os.path.join(args.results, "logs", f"{started}-disagg")
    if not args.dry_run:
        os.makedirs(log_dir, exist_ok=True)
    if not args.dry_run and os.getloadavg()[0] > 1.0:
        say(f"warning: load average {os.getloadavg()[0]:.1f}: latencies are only meaningful on a quiet machine")
    records = [run_system(s, args, log_dir) for s in args.systems]
    if args.dry_run:
        for rec in records:
            print(" ".join(rec["server_cmd"]))
            for run in rec["runs"]:
                print("   ", " ".join(run["bench_cmd"]))
        return 0
    summary = {"command": "python -m benchmarks.disagg " + " ".join(argv), "model": args.model,
               "prefill_cores": args.prefill_cores, "decode_cores": args.decode_cores, "slo": args.slo,
               "rate": args.rate, "machine": compare.machine_info(), "loadavg_end": compare.loadavg(),
               "log_dir": log_dir, "systems": records}
    path = os.path.join(args.results, "disagg.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    png = plot(records, args.plot or os.path.join(args.results, "disagg.png"),
               f"{os.path.basename(os.path.normpath(args.model))}: colocated on cores "
               f"{format_cores(sorted(set(args.prefill_cores) | set(args.decode_cores)))} vs prefill core "
               f"{format_cores(args.prefill_cores)} + decode core {format_cores(args.decode_cores)}")
    print(table(records))
    say(f"wrote {path} and {png}")
    return 0 if all(r.get("status") == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
