"""Simulator validation: the same workload through a real pdserve deployment (measured by `pdserve
bench`) and through `pdserve simulate`, side by side: mean TTFT, mean TPOT, output throughput and
the error of each prediction (the target is within 15%).

Per model and deployment: fit the step-time model on this machine as its engines run (`pdserve
simulate --fit-cost-model --save-cost-model`; one thread pinned to one core for 1P1D's workers and
the Ray replicas), start the deployment with `--step-log`, run each workload with `pdserve bench
--vocab-size V` (so both sides draw the same prompt ids, lengths and arrival times), and simulate
it twice: with the model fitted before (end to end: that fit never saw the measured run), and
with one fitted on the deployment's own logged steps of the run (`--step-log`: the simulation of
scheduling, routing and queueing given the step costs; on a machine shared with other work the
first drifts with the load, the second much less). For 1P1D the KV hand-off's --kv-bandwidth and
--kv-latency-ms come from `benchmarks.kv_transfer --cache-only` (TCP, this machine) and the proxy's
overhead on the warm-up (prior), or the run's own pulls and proxy overhead (run's steps). Writes
RESULTS/sim/validate.json and a Markdown table to stdout.

    python -m benchmarks.sim_validate --quick                      # tiny model, 2 workloads per deployment
    python -m benchmarks.sim_validate --model-05b /work/q05        # and the 0.5B-shaped model
    python -m benchmarks.sim_validate --deployments engine 1p1d    # some of the deployments
    python -m benchmarks.sim_validate --dry-run                    # the commands only

Deployments (DEPLOYMENTS): `engine` (one `pdserve serve`), `1p1d` (`pdserve serve --disaggregate`:
a prefill and a decode worker on a core each, behind the proxy) and `ray2` (`pdserve serve --ray
--num-replicas 2 --ray-cpus-per-replica 1` on a local Ray instance, prefix-aware routing, which the
simulator runs as `--router prefix-aware`); one whose launch this checkout lacks is listed as not
measured."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from benchmarks.sim_hops import (KV_PROMPT_LENS, PROBE, handoff, handoff_metrics, kv_flags, kv_link, router_latency,
                                 run_logged, shown)
from pdserve.bench import servers
from pdserve.engine.args import DEFAULT_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 3000
TARGET_PCT = 15.0
METRICS = (("mean_ttft_ms", "mean TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"),
           ("output_throughput", "throughput (tok/s)"))


@dataclass(frozen=True)
class Workload:
    name: str
    flags: tuple[str, ...]   # pdserve bench's and pdserve simulate's dataset and load flags


def workloads(model_kind: str, quick: bool) -> list[Workload]:
    """Closed loop at concurrency 4, and Poisson arrivals near the engine's capacity."""
    if model_kind == "tiny":
        n = "12" if quick else "64"
        return [Workload("random 128/64 c4", ("--random-input-len", "128", "--random-output-len", "64",
                                              "--num-prompts", n, "--max-concurrency", "4")),
                Workload("long-short rate 4", ("--dataset-name", "long-short", "--random-input-len", "64",
                                               "--long-input-len", "768", "--random-output-len", "48",
                                               "--num-prompts", n, "--request-rate", "4"))]
    n = "6" if quick else "16"
    return [Workload("random 128/32 c4", ("--random-input-len", "128", "--random-output-len", "32",
                                          "--num-prompts", n, "--max-concurrency", "4")),
            Workload("random 256/32 rate 0.5", ("--random-input-len", "256", "--random-output-len", "32",
                                                "--num-prompts", n, "--request-rate", "0.5"))]


@dataclass(frozen=True)
class Deployment:
    name: str
    serve_flags: tuple[str, ...]   # `pdserve serve` flags that launch it
    sim_flags: tuple[str, ...]     # `pdserve simulate` placement flags
    fit_flags: tuple[str, ...] = ()           # one engine's flags as it runs there, for the prior fit
    fit_cores: tuple[int, ...] | None = None  # and the cores the fit is pinned to (as the worker is)
    roles: tuple[str, ...] = ()    # the launcher writes --step-log FILE's .ROLE variants, one per worker
    kv: bool = False               # the simulation takes the KV hand-off's --kv-bandwidth and --kv-latency-ms
    probe: bool = False            # and --router-latency-ms, measured on a probe before the run
    needs: str | None = None       # a `pdserve serve --help` flag its launch needs
    needs_module: str | None = None   # and a module (an optional extra)

    def missing(self) -> str | None:
        if self.needs_module and importlib.util.find_spec(self.needs_module) is None:
            return f"needs the {self.needs_module} extra (pip install -e '.[{self.needs_module}]')"
        if self.needs is None:
            return None
        text = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--help"], capture_output=True,
                              text=True).stdout
        return None if self.needs in text else f"needs `pdserve serve {self.needs}`, not in this checkout"

    def step_logs(self, path: str) -> list[str]:
        root, ext = os.path.splitext(path)
        return [f"{root}.{role}{ext}" for role in self.roles] if self.roles else [path]


# Each worker of 1P1D (the launcher pins prefill to core 0, decode to core 1) and each Ray replica
# (--ray-cpus-per-replica 1) runs one forward thread: their step-time model is fitted on one thread
# pinned to one core. Ray's router is prefix-aware by default; the simulator runs that router's code.
ONE_CORE = dict(fit_flags=("--threads", "1"), fit_cores=(0,))
DEPLOYMENTS = {
    # probe: the server's own hop (HTTP, tokenizing, the hand-over to the engine thread) delays each
    # arrival too; in a closed loop it decides whether a request makes the step that starts next
    "engine": Deployment("1 engine", (), ("--replicas", "1"), probe=True),
    "1p1d": Deployment("1P1D", ("--disaggregate",), ("--prefill-replicas", "1", "--decode-replicas", "1"),
                       roles=("prefill", "decode"), kv=True, needs="--disaggregate", **ONE_CORE),
    # --ray-address local: a Ray instance of its own, never one that other work on the machine started
    "ray2": Deployment("2 replicas (Ray)", ("--ray", "--ray-address", "local", "--num-replicas", "2",
                                            "--ray-cpus-per-replica", "1", "--routing", "prefix-aware"),
                       ("--replicas", "2", "--router", "prefix-aware"), probe=True, needs="--ray", needs_module="ray",
                       **ONE_CORE),
}

def error_pct(measured: float, predicted: float) -> float | None:
    return None if not measured else 100.0 * (predicted - measured) / measured


def compare(measured: dict, predicted: dict[str, dict]) -> list[dict]:
    """Per metric: the measured value, and each prediction with its error."""
    return [{"metric": title, "measured": measured[key],
             **{f"predicted_{name}": p[key] for name, p in predicted.items()},
             **{f"error_pct_{name}": error_pct(measured[key], p[key]) for name, p in predicted.items()}}
            for key, title in METRICS]


def steps_flags(logs: list[str], roles: tuple[str, ...], counted: bool = True) -> list[str]:
    """--step-log for the run's steps; with a prefill and a decode worker, each pool its own
    model, unless the prefill worker took too few steps to fit one (then one model of both)."""
    from pdserve.sim.steplog import MIN_STEPS
    by_role = dict(zip(roles, logs))
    if "prefill" in by_role and "decode" in by_role:
        if not counted:
            return ["--step-log", by_role["decode"], "--prefill-step-log", by_role["prefill"]]
        with open(by_role["prefill"]) as f:
            if sum(1 for line in f if line.strip()) >= MIN_STEPS:
                return ["--step-log", by_role["decode"], "--prefill-step-log", by_role["prefill"]]
    return ["--step-log", *logs]


@dataclass
class Job:
    """One workload on one deployment: the server, the commands to measure it and to simulate it."""
    workload: Workload
    tag: str
    server: servers.Server
    logs: list[str]              # the step logs the deployment writes
    warmup: list[str]
    bench: list[str]
    sim: list[str]               # without the step-time model's flags
    probe: list[str] | None = None       # the router-latency probe, and its simulation
    probe_sim: list[str] | None = None


def measure(job: Job, dep: Deployment, out_dir: str) -> tuple[int, dict, dict]:
    """Start the deployment, warm it up (and probe it), empty its step logs, run the workload:
    (bench's exit status, the hand-off metrics before and after the run)."""
    for log in job.logs:
        if os.path.exists(log):
            os.remove(log)   # the server appends
    try:
        job.server.start(timeout=900)
    except servers.PeerError as e:   # e.g. Ray's HTTP proxy failing its health checks on a loaded machine
        print(f"{e}\nstarting it once more", file=sys.stderr, flush=True)
        job.server.start(timeout=900)
    with job.server:
        run_logged(job.warmup, os.path.join(out_dir, f"{job.tag}-warmup.log"), 900)
        if job.probe:   # its steps are dropped with the warm-up's
            run_logged(job.probe, os.path.join(out_dir, f"{job.tag}-probe.log"), 900)
        for log in job.logs:
            with open(log, "r+") as f:   # the server appends (O_APPEND): it writes on from 0
                f.truncate(0)
        before = handoff_metrics(job.server) if dep.kv else {}
        rc = run_logged(job.bench, os.path.join(out_dir, f"{job.tag}-bench.log"), 900)
        after = handoff_metrics(job.server) if dep.kv else {}
    return rc, before, after


def predict(job: Job, dep: Deployment, cost_file: str, link: dict | None, before: dict, after: dict,
            out_dir: str) -> tuple[dict, dict]:
    """({"prior": ..., "steps": ...} simulation results, what the row records of how they were set up)."""
    steps = steps_flags(job.logs, dep.roles)
    sims, extra = {"prior": job.sim + ["--cost-model", cost_file], "steps": job.sim + steps}, {"steps_fit": steps}
    if job.probe_sim:
        extra["router_latency"] = router_latency(job.probe, job.probe_sim, out_dir, job.tag)
        for name in sims:
            sims[name] += ["--router-latency-ms", f"{extra['router_latency']['latency_ms']:.4g}"]
    if dep.kv:
        # before the run: the link as kv_transfer measured it, plus the proxy's overhead on the
        # warm-up; the run's steps: the run's own pulls and proxy overhead
        bw = link["bandwidth_gb_s"]
        warm, run = handoff({}, before, bw), handoff(before, after, bw)
        prior_ms = link["latency_ms"] + (warm["latency_ms"] - warm["pull_latency_ms"] if warm else 0.0)
        extra.update(kv_link=link, handoff_warmup=warm, handoff_run=run, handoff_metrics={"before": before,
                                                                                          "after": after})
        sims["prior"] += kv_flags(bw, prior_ms)
        sims["steps"] += kv_flags(run["bandwidth_gb_s"], run["latency_ms"]) if run else kv_flags(bw, prior_ms)
    predicted = {}
    for name, cmd in sims.items():
        out, log = (os.path.join(out_dir, f"{job.tag}-sim-{name}.{ext}") for ext in ("json", "log"))
        if run_logged(cmd + ["--output", out], log, 900):
            raise RuntimeError(f"pdserve simulate failed: see {log}")
        with open(out) as f:
            predicted[name] = json.load(f)
    return predicted, extra


def validate_model(label: str, model: str, kind: str, args, out_dir: str) -> list[dict]:
    from pdserve.config import ModelConfig
    vocab = ModelConfig.from_dir(model).vocab_size
    engine_flags = args.engine_args.split()
    py = [sys.executable, "-m", "pdserve"]
    fitted: set[str] = set()   # cost model files: deployments whose engines run alike share one

    def fit_for(dep: Deployment) -> tuple[list[str], tuple | None, str, str]:
        """(command, cores, cost model file, log) of the prior fit for this deployment's engines."""
        suffix = "" if (dep.fit_flags, dep.fit_cores) == ((), None) else "-1core"
        cost_file = os.path.join(out_dir, f"{label}-cost-model{suffix}.json")
        cmd = py + ["simulate", "--fit-cost-model", "--save-cost-model", cost_file, "--model", model,
                    "--num-prompts", "1", *engine_flags, *dep.fit_flags]
        return cmd, dep.fit_cores, cost_file, os.path.join(out_dir, f"{label}-fit{suffix}.log")

    def job_for(key: str, dep: Deployment, w: Workload, cost_file: str) -> Job:
        """A fresh server per workload, so its step log holds that run's steps only."""
        tag = f"{label}-{key}-{w.name.replace(' ', '_').replace('/', '-')}"
        port, step_log = servers.free_port(), os.path.join(out_dir, f"{tag}-steps.jsonl")
        cmd = py + ["serve", "--model", model, "--port", str(port), "--log-level", "warning", "--step-log", step_log,
                    *engine_flags, *dep.serve_flags]
        server = servers.Server(f"pdserve-{tag}", cmd, port, os.path.join(out_dir, f"{tag}-server.log"))
        common = py + ["bench", "--base-url", server.base_url, "--vocab-size", str(vocab), "--disable-tqdm"]
        sim = py + ["simulate", "--model", model, "--seed", str(SEED), *dep.sim_flags, *engine_flags, *w.flags]
        job = Job(w, tag, server, dep.step_logs(step_log),
                  # the warm-up is a run of its own (other prompts), so the step log can be emptied after it
                  common + ["--seed", str(SEED + 1), *w.flags, "--num-prompts", "2"],
                  common + ["--seed", str(SEED), "--output", os.path.join(out_dir, f"{tag}-bench.json"), *w.flags],
                  sim)
        if dep.probe:
            probe_out = os.path.join(out_dir, f"{tag}-probe.json")
            job.probe = common + ["--seed", str(SEED + 2), *PROBE, "--output", probe_out]
            job.probe_sim = py + ["simulate", "--model", model, "--seed", str(SEED + 2), *dep.sim_flags, *engine_flags,
                                  *PROBE, "--cost-model", cost_file]
        return job

    link = None
    rows = []
    for key, dep in DEPLOYMENTS.items():
        if key not in args.deployments:
            continue
        why = dep.missing()
        if why:
            rows.append({"model": label, "deployment": dep.name, "workload": "-", "not_measured": why})
            continue
        fit, cores, cost_file, fit_log = fit_for(dep)
        jobs = [job_for(key, dep, w, cost_file) for w in workloads(kind, args.quick)]
        if args.dry_run:
            if cost_file not in fitted:
                fitted.add(cost_file)
                print(shown(fit, cores))
            if dep.kv:
                print(" ".join([sys.executable, "-m", "benchmarks.kv_transfer", model, "--cache-only", "--transports",
                                "tcp", "--prompt-len", "N"]) + f"  # N = {', '.join(map(str, KV_PROMPT_LENS))}")
            for job in jobs:
                print(" ".join(job.server.cmd))
                for cmd in (job.warmup, job.probe, job.bench, job.probe_sim):
                    if cmd:
                        print("  " + " ".join(cmd))
                extra = (["--kv-bandwidth", "GB_S", "--kv-latency-ms", "MS"] if dep.kv else []) + \
                        (["--router-latency-ms", "MS"] if dep.probe else [])   # measured
                print("  " + " ".join(job.sim + ["--cost-model", cost_file] + extra))
                print("  " + " ".join(job.sim + steps_flags(job.logs, dep.roles, counted=False) + extra))
            continue
        if cost_file not in fitted:
            t0 = time.monotonic()
            if run_logged(fit, fit_log, 900, cores):
                raise RuntimeError(f"fitting the cost model failed: see {fit_log}")
            fitted.add(cost_file)
            where = f" on core(s) {','.join(map(str, cores))}" if cores else ""
            print(f"{label}: cost model fitted{where} ({time.monotonic() - t0:.0f} s)", flush=True)
        if dep.kv and link is None:
            link = kv_link(model, out_dir, label)
            print(f"{label}: KV pull over TCP {link['bandwidth_gb_s']:.2f} GB/s + {link['latency_ms']:.2f} ms",
                  flush=True)
        for job in jobs:
            t0 = time.monotonic()
            rc, before, after = measure(job, dep, out_dir)
            print(f"{label} {dep.name} {job.workload.name}: bench exit {rc} ({time.monotonic() - t0:.0f} s)",
                  flush=True)
            predicted, extra = predict(job, dep, cost_file, link, before, after, out_dir)
            with open(os.path.join(out_dir, f"{job.tag}-bench.json")) as f:
                measured = json.load(f)
            rows.append({"model": label, "deployment": dep.name, "workload": job.workload.name,
                         "failed": measured["failed"], "metrics": compare(measured, predicted), **extra})
    return rows


def markdown(rows: list[dict], load: str) -> str:
    lines = [f"Measured under contention (load average before the run: {load}). Predicted by `pdserve simulate` with "
             "the step-time model fitted on this machine before the run (prior fit), and with one fitted on the "
             "server's own logged steps of the run (run's steps).", "",
             "| model | deployment | workload | metric | measured | predicted (prior fit) | error | "
             "predicted (run's steps) | error |", "|---|---|---|---|---|---|---|---|---|"]
    err = lambda e: "-" if e is None else f"{e:+.1f}%" + ("" if abs(e) <= TARGET_PCT else " (over 15%)")   # noqa: E731
    for r in rows:
        if "not_measured" in r:
            lines.append(f"| {r['model']} | {r['deployment']} | - | not measured: {r['not_measured']} | | | | | |")
            continue
        for m in r["metrics"]:
            lines.append(f"| {r['model']} | {r['deployment']} | {r['workload']} | {m['metric']} | "
                         f"{m['measured']:.2f} | {m['predicted_prior']:.2f} | {err(m['error_pct_prior'])} | "
                         f"{m['predicted_steps']:.2f} | {err(m['error_pct_steps'])} |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="the small model (default: the bundled one)")
    p.add_argument("--model-05b", default=None, metavar="DIR",
                   help="also validate on this model (`python -m tools.make_model DIR --arch qwen2 --size 0.5b`)")
    p.add_argument("--skip-tiny", action="store_true", help="only the --model-05b model")
    p.add_argument("--engine-args", default="", help="extra engine flags for serve, the fit and simulate, one string")
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--quick", action="store_true", help="fewer requests per workload")
    p.add_argument("--deployments", nargs="+", choices=list(DEPLOYMENTS), default=list(DEPLOYMENTS),
                   help="which to validate (default: all)")
    p.add_argument("--dry-run", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = os.path.join(args.results, "sim")
    os.makedirs(out_dir, exist_ok=True)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    models = ([] if args.skip_tiny else [("tiny", args.model, "tiny")]) + \
             ([("0.5b", args.model_05b, "0.5b")] if args.model_05b else [])
    rows = [row for label, model, kind in models for row in validate_model(label, model, kind, args, out_dir)]
    if args.dry_run:
        return 0
    with open(os.path.join(out_dir, "validate.json"), "w") as f:
        json.dump({"load_average": load, "engine_args": args.engine_args, "rows": rows}, f, indent=1)
    print(markdown(rows, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
