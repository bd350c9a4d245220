"""Chunked-prefill budget sweep: how the engine's step token budget trades TTFT for ITL.

Issue 6, target 6: on the long-short workload the short requests' p99 ITL must be at most 2x
their median. A long prompt's prefill shares every engine step with the running decodes, cut
into chunks of at most `--max-num-batched-tokens` (the step budget) minus the decodes. A small
budget keeps each step short (steady ITL) but spreads a long prefill over many steps (long TTFT);
a large one finishes prefills sooner but stalls every decode in the steps that carry a big chunk.

The decode-aware prefill cap (`--max-prefill-tokens-with-decodes`, off in the engine by default)
bounds the prefill tokens of a step that also decodes, whatever the budget: `--caps` sweeps it
(0 = off), crossed with the budgets.

One command: for each (budget, cap) point, start the engine with `--max-num-batched-tokens
BUDGET --max-prefill-tokens-with-decodes CAP`, run compare.py's long-short workload (or, with
`--bench c32`, its c32 workload) for that model with `pdserve bench` (same prompts for every
point: one seed), stop it; `--rounds N` repeats all points N times, interleaved, so that a busy
neighbour weighs on every point alike. Then write the numbers to RESULTS/<workload>[-NAME].json
(each bench result under RESULTS/<workload>[-NAME]/), a plot to RESULTS/<workload>[-NAME].png
and a table to stdout. The default sweeps budgets only, with the cap off (`--caps 0`).

    python -m benchmarks.budget_sweep --quick                  # tiny model, 3 budgets, < 1 min
    python -m benchmarks.budget_sweep                          # the bundled tiny model, 6 budgets (~2 min)
    python -m benchmarks.budget_sweep --model /work/q05        # the 0.5B model (~4 min)
    python -m benchmarks.budget_sweep --model /work/q05 --budgets 512 --caps 0,16,32,64 --name caps
    python -m benchmarks.budget_sweep --model /work/q05 --bench c32 --budgets 512 --caps 0,32 --name c32
    python -m benchmarks.budget_sweep --dry-run                # the commands only
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime

import numpy as np

from benchmarks import compare, peers
from benchmarks.workloads import WARMUP, WORKLOADS, Workload
from pdserve.bench import servers

from pdserve.bench.report import latency_samples  # noqa: E402

REPO = compare.REPO
DEFAULT_BUDGETS = (32, 64, 128, 256, 512, 1024)  # 512 is the engine's default
QUICK_BUDGETS = (32, 128, 512)
DEFAULT_CAPS = (0,)  # --max-prefill-tokens-with-decodes; 0 = off
BENCHES = ("long-short", "c32")
TARGET = 2.0  # the short requests' p99 ITL over their median
SEED = 7000


# ---------------------------------------------------------------- the numbers

def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(res: dict) -> dict:
    """The sweep's numbers from one long-short result of `pdserve bench --output`, recomputed
    from its per-request arrays (`ttfts`, `itls`, `output_lens`, `errors`, `request_kinds`):
    for the short requests the median and p99 ITL (pooled over their gaps), p99/median, mean and
    p99 TTFT; for the long ones the mean TTFT; and the run's output throughput. Times in ms."""
    short, long_ = latency_samples(res, "short"), latency_samples(res, "long")
    if short is None or "request_kinds" not in res:
        raise ValueError("not a long-short result with per-request arrays (ttfts, itls, request_kinds)")
    median, p99 = _pct(short["itl"], 50), _pct(short["itl"], 99)
    ratio = p99 / median if median else None
    return {
        "short_completed": len(short["ttft"]), "long_completed": len(long_["ttft"]), "failed": res.get("failed"),
        "short_median_itl_ms": median, "short_p99_itl_ms": p99, "short_itl_p99_over_median": ratio,
        "short_mean_ttft_ms": float(np.mean(short["ttft"])) if short["ttft"] else None,
        "short_p99_ttft_ms": _pct(short["ttft"], 99),
        "long_mean_ttft_ms": float(np.mean(long_["ttft"])) if long_["ttft"] else None,
        "output_throughput": res.get("output_throughput"),
        "meets_target": ratio is not None and ratio <= TARGET,
    }


def summarize_c32(res: dict) -> dict:
    """The c32 numbers of one `pdserve bench --output` result (its own aggregates). Times in ms."""
    return {k: res.get(k) for k in ("completed", "failed", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                                    "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms")}


def point_label(budget: int, cap: int) -> str:
    return f"b{budget}-cap{cap}" if cap else f"b{budget}-nocap"


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (budget, cap) point, in first-run order: with several rounds, the median of each
    number over the rounds that produced one (`rounds` counts them); the runs themselves stay in
    `runs` of the results file."""
    points: dict[tuple, list[dict]] = {}
    for r in rows:
        points.setdefault((r["budget"], r.get("cap", 0)), []).append(r)
    out = []
    for (budget, cap), runs in points.items():
        done = [r["metrics"] for r in runs if r.get("metrics")]
        row = dict(budget=budget, cap=cap, rounds=len(done), status=runs[-1]["status"] if not done else "ok")
        if done:
            m = {}
            for k, v in done[0].items():
                vals = [d[k] for d in done if isinstance(d.get(k), (int, float)) and not isinstance(d.get(k), bool)]
                m[k] = float(np.median(vals)) if vals and not isinstance(v, bool) else v
            if "short_itl_p99_over_median" in m:
                ratio = m["short_itl_p99_over_median"]
                m["meets_target"] = ratio is not None and ratio <= TARGET
            row["metrics"] = m
        out.append(row)
    return out


def recommend(rows: list[dict]) -> dict | None:
    """The point (budget, cap) to use: the highest output throughput among those meeting the
    target, else the one nearest to it."""
    done = [r for r in rows if r.get("metrics") and r["metrics"]["short_itl_p99_over_median"] is not None]
    ok = [r for r in done if r["metrics"]["meets_target"]]
    if ok:
        return max(ok, key=lambda r: r["metrics"]["output_throughput"] or 0)
    return min(done, key=lambda r: r["metrics"]["short_itl_p99_over_median"], default=None)


# ---------------------------------------------------------------- output

def fmt(v, digits: int = 0) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def table(rows: list[dict], bench: str = "long-short") -> str:
    """One line per row; with rounds, a row's numbers are medians over its `rounds` runs."""
    if bench == "c32":
        head = ("budget", "cap", "runs", "out tok/s", "TTFT mean", "TTFT p99", "ITL p50", "ITL p99")
        keys = (("output_throughput", 1), ("mean_ttft_ms", 0), ("p99_ttft_ms", 0), ("median_itl_ms", 1),
                ("p99_itl_ms", 1))
    else:
        head = ("budget", "cap", "runs", "short ITL p50", "short ITL p99", "p99/p50", "short TTFT mean",
                "short TTFT p99", "long TTFT mean", "out tok/s", f"<= {TARGET:g}x")
        keys = (("short_median_itl_ms", 1), ("short_p99_itl_ms", 1), ("short_itl_p99_over_median", 2),
                ("short_mean_ttft_ms", 0), ("short_p99_ttft_ms", 0), ("long_mean_ttft_ms", 0),
                ("output_throughput", 1), ("meets_target", None))
    lines = ["  ".join(f"{h:>15}" for h in head)]
    for r in rows:
        m = r.get("metrics")
        cells = [r["budget"], r.get("cap", 0) or "off", r.get("rounds", 1)]
        if not m:
            cells += [r["status"]] + [""] * (len(keys) - 1)
        else:
            cells += [("yes" if m.get(k) else "no") if d is None else fmt(m.get(k), d) for k, d in keys]
        lines.append("  ".join(f"{c:>15}" for c in cells))
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> str | None:
    """Budget (log2) against the short requests' ITL (median, p99, their ratio with the target)
    and against TTFT (short mean and p99, long mean) with the output throughput."""
    rows = [r for r in rows if r.get("metrics")]
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")   # files only, no display
    import matplotlib.pyplot as plt

    by_cap = len({r.get("cap", 0) for r in rows}) > 1
    x = list(range(len(rows))) if by_cap else [r["budget"] for r in rows]
    labels = [f"{r['budget']}/{r.get('cap', 0) or 'off'}" for r in rows] if by_cap else [str(b) for b in x]

    def ys(key):
        return [np.nan if r["metrics"][key] is None else r["metrics"][key] for r in rows]

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    a1.plot(x, ys("short_median_itl_ms"), "o-", label="short ITL median")
    a1.plot(x, ys("short_p99_itl_ms"), "s-", label="short ITL p99")
    a1.set_ylabel("ms")
    r1 = a1.twinx()
    r1.plot(x, ys("short_itl_p99_over_median"), "^--", color="tab:red", label="p99 / median")
    r1.axhline(TARGET, color="tab:red", lw=0.8, ls=":", label=f"target {TARGET:g}x")
    r1.set_ylabel("p99 / median")
    r1.set_ylim(bottom=0)
    a1.set_title("short requests: inter-token latency")
    a2.plot(x, ys("short_mean_ttft_ms"), "o-", label="short TTFT mean")
    a2.plot(x, ys("short_p99_ttft_ms"), "s-", label="short TTFT p99")
    a2.plot(x, ys("long_mean_ttft_ms"), "D-", label="long TTFT mean")
    a2.set_ylabel("ms")
    r2 = a2.twinx()
    r2.plot(x, ys("output_throughput"), "x--", color="tab:gray", label="output tok/s")
    r2.set_ylabel("output tokens/s")
    r2.set_ylim(bottom=0)
    a2.set_title("time to first token, throughput")
    for ax, twin in ((a1, r1), (a2, r2)):
        if not by_cap:
            ax.set_xscale("log", base=2)
        ax.set_xticks(x, labels)
        ax.set_xlabel("--max-num-batched-tokens / --max-prefill-tokens-with-decodes" if by_cap else
                      "--max-num-batched-tokens (step token budget)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = twin.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- the run

def server_for(model_dir: str, budget: int, log_dir: str, cap: int = 0, tag: str = "") -> servers.Server:
    port = servers.free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model_dir, "--port", str(port),
           "--max-model-len", str(peers.context_len(model_dir)), "--max-num-batched-tokens", str(budget),
           "--max-prefill-tokens-with-decodes", str(cap), "--log-level", "warning"]
    name = f"engine-{point_label(budget, cap)}{tag}"
    return servers.Server(name, cmd, port, os.path.join(log_dir, f"{name}.log"),
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


def run_budget(budget: int, model_dir: str, wl: Workload, key: str, args, log_dir: str, cap: int = 0,
               rnd: int = 0) -> dict:
    """Start the engine with this budget and cap, warm it up, run the workload, stop it."""
    name = os.path.basename(os.path.normpath(model_dir))
    tag = f"-r{rnd + 1}" if args.rounds > 1 else ""
    label = point_label(budget, cap) + tag
    server = server_for(model_dir, budget, log_dir, cap, tag)
    out = os.path.join(args.out_dir, args.result_name, f"{label}.json")
    row = dict(budget=budget, cap=cap, round=rnd + 1, status="not run", server_cmd=server.cmd,
               bench_cmd=compare.bench_command(server, name, wl, SEED, out))
    if args.dry_run:
        return row
    row["busy_cores_before"] = compare.busy_cores()
    say(f"{label}: starting the engine; other work keeps {row['busy_cores_before']} cores busy")
    try:
        server.start(timeout=args.start_timeout)
    except servers.PeerError as e:
        return dict(row, status="start failed", error=str(e))
    try:
        row["server_ready_s"] = round(server.ready_s, 1)
        warm = compare.bench_command(server, name, WARMUP, SEED + 50, None)
        with open(os.path.join(log_dir, f"bench-warmup-{label}.log"), "w", encoding="utf-8") as f:
            try:  # a failed warm-up shows again, measured, in the run itself
                subprocess.run(warm, stdout=f, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, timeout=compare.bench_timeout(WARMUP, key))
            except subprocess.TimeoutExpired:
                f.write("\nwarm-up timed out\n")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if os.path.exists(out):
            os.remove(out)
        t0 = time.monotonic()
        blog = os.path.join(log_dir, f"bench-{label}.log")
        try:
            with open(blog, "w", encoding="utf-8") as f:
                rc = subprocess.run(row["bench_cmd"], stdout=f, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL,
                                            timeout=compare.bench_timeout(wl, key)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        row["bench_s"] = round(time.monotonic() - t0, 1)
        if not os.path.exists(out):
            return dict(row, status="bench failed", error=f"pdserve bench exit {rc}: {servers.log_tail(blog, 8)}")
        with open(out, encoding="utf-8") as f:
            res = json.load(f)
        row.update(status="ok" if res.get("failed", 0) == 0 else "some failed", json=os.path.relpath(out, REPO),
                   metrics=summarize_c32(res) if args.bench == "c32" else summarize(res))
        return row
    finally:
        server.stop()


def say(msg: str) -> None:
    print(f"[budget_sweep {datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv):
    from pdserve.data import DEFAULT_MODEL_DIR

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="checkpoint directory (default: the bundled tiny model)")
    p.add_argument("--budgets", default=None,
                   help="comma-separated --max-num-batched-tokens values (default: "
                        f"{','.join(map(str, DEFAULT_BUDGETS))}; with --quick {','.join(map(str, QUICK_BUDGETS))})")
    p.add_argument("--caps", default=None,
                   help="comma-separated --max-prefill-tokens-with-decodes values, 0 = off, each crossed with every "
                        "budget (default: 0, i.e. the budget alone)")
    p.add_argument("--bench", choices=BENCHES, default="long-short",
                   help="which of compare.py's workloads each point runs: long-short (head-of-line blocking, "
                        "the default) or c32 (throughput and TTFT under load)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every point this many times, interleaved (round 1 of all points, then round 2...); "
                        "the table shows medians over the rounds")
    p.add_argument("--name", default=None,
                   help="results go to RESULTS/<workload>-NAME.json and RESULTS/<workload>-NAME/ (default: "
                        "RESULTS/<workload>.json; c32 runs: <workload>-c32)")
    p.add_argument("--quick", action="store_true", help="compare.py's quick long-short workload, 3 budgets (< 1 min "
                   "on the tiny model)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                   help="whose long-short workload of compare.py to run (default: quick with --quick, tiny for "
                        "the bundled model, 0.5b for any other)")
    p.add_argument("--out-dir", default=None,
                   help="default: benchmarks/results/budget_sweep (benchmarks/results/quick/budget_sweep with --quick)")
    p.add_argument("--cache-dir", default=compare.DEFAULT_CACHE, help="server and bench logs go under CACHE_DIR/logs")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server gets to become healthy")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    try:
        args.budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()}) if args.budgets else \
            list(QUICK_BUDGETS if args.quick else DEFAULT_BUDGETS)
    except ValueError:
        p.error(f"--budgets takes comma-separated integers, got {args.budgets!r}")
    if not args.budgets or args.budgets[0] < 1:
        p.error("--budgets must be positive")
    try:
        args.caps = sorted({int(c) for c in args.caps.split(",") if c.strip()}) if args.caps else list(DEFAULT_CAPS)
    except ValueError:
        p.error(f"--caps takes comma-separated integers, got {args.caps!r}")
    if not args.caps or args.caps[0] < 0:
        p.error("--caps must be >= 0 (0 = no cap)")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.name is not None and (not args.name or "/" in args.name or args.name.startswith(".")):
        p.error(f"--name must be a plain file-name part, got {args.name!r}")
    args.model = os.path.abspath(args.model)
    if not os.path.exists(os.path.join(args.model, "config.json")):
        p.error(f"--model {args.model} has no config.json")
    args.workload = args.workload or ("quick" if args.quick else "tiny" if args.model == os.path.abspath(
        DEFAULT_MODEL_DIR) else "0.5b")
    name = args.name or ("c32" if args.bench == "c32" else None)
    args.result_name = f"{args.workload}-{name}" if name else args.workload
    args.out_dir = os.path.abspath(args.out_dir or os.path.join(REPO, "benchmarks", "results",
                                                                 *(["quick"] if args.quick else []), "budget_sweep"))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the running server is stopped
    key = args.workload
    wl = next(w for w in WORKLOADS[key] if w.name == args.bench)
    started, t0 = datetime.now(), time.monotonic()
    log_dir = os.path.join(args.cache_dir, "logs", started.strftime("%Y%m%d-%H%M%S") + "-budget-sweep")
    if os.getloadavg()[0] > 1.0 and not args.dry_run:
        say(f"warning: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: ITL percentiles "
            "are only meaningful on a quiet machine")
    points = [(b, c) for b in args.budgets for c in args.caps]
    say(f"{args.model}: {wl.describe()}; budget/cap points {', '.join(f'{b}/{c}' for b, c in points)}"
        + (f", {args.rounds} rounds" if args.rounds > 1 else ""))
    rows = []
    for rnd in range(1 if args.dry_run else args.rounds):
        for budget, cap in points:
            rows.append(run_budget(budget, args.model, wl, key, args, log_dir, cap, rnd))
            if not args.dry_run:
                say(f"{point_label(budget, cap)} round {rnd + 1}: {rows[-1]['status']}"
                    + (f" in {rows[-1]['bench_s']:.0f} s" if "bench_s" in rows[-1] else ""))
    if args.dry_run:
        for r in rows:
            print(" ".join(r["server_cmd"]))
            print("   ", " ".join(r["bench_cmd"]))
        return 0
    points_rows = aggregate(rows)
    best = recommend(points_rows) if args.bench == "long-short" else None
    summary = {"started": started.strftime("%Y-%m-%d %H:%M"), "duration_s": round(time.monotonic() - t0, 1),
               "command": "python -m benchmarks.budget_sweep " + " ".join(argv), "model_dir": args.model,
               "workload": asdict(wl), "bench": args.bench, "rounds": args.rounds,
               "target_p99_over_median": TARGET, "seed": SEED,
               "machine": compare.machine_info(), "loadavg_end": compare.loadavg(), "log_dir": log_dir,
               "recommended_budget": best["budget"] if best else None,
               "recommended_cap": best["cap"] if best else None, "points": points_rows, "runs": rows}
    path = os.path.join(args.out_dir, f"{args.result_name}.json")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    png = None if args.bench == "c32" else plot(
        points_rows, os.path.join(args.out_dir, f"{args.result_name}.png"),
        f"{os.path.basename(args.model)}: {wl.describe()} (engine, one server per point"
        + (f", median of {args.rounds} rounds)" if args.rounds > 1 else ")"))
    print(table(points_rows, args.bench))
    if best:
        m = best["metrics"]
        print(f"recommended: budget {best['budget']}, cap {best['cap'] or 'off'} "
              f"(short ITL p99/median {m['short_itl_p99_over_median']:.2f}, "
              f"{'meets' if m['meets_target'] else 'misses'} the {TARGET:g}x target; "
              f"{m['output_throughput']:.1f} output tok/s)")
    say(f"wrote {path}" + (f" and {png}" if png else "") + f" in {(time.monotonic() - t0) / 60:.1f} min")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
