"""Simulator validation: the same workload through a real pdserve server (measured by `pdserve
bench`) and through `pdserve simulate`, side by side: mean TTFT, mean TPOT, output throughput and
the error of each prediction (the target is within 15%).

Per model: fit the step-time model on this machine (`pdserve simulate --fit-cost-model
--save-cost-model`), start `pdserve serve --step-log`, run each workload with `pdserve bench
--vocab-size V` (so both sides draw the same prompt ids, lengths and arrival times), and simulate
it twice: with the model fitted before (end to end: that fit never saw the measured run), and
with one fitted on the server's own logged steps of the run (`--step-log`: the simulation of
scheduling and queueing given the step costs; on a machine shared with other work the first
drifts with the load, the second much less). Writes RESULTS/sim/validate.json and a Markdown
table to stdout.

    python -m benchmarks.sim_validate --quick                      # tiny model, 2 workloads (~3 min)
    python -m benchmarks.sim_validate --model-05b /work/q05        # and the 0.5B-shaped model
    python -m benchmarks.sim_validate --dry-run                    # the commands only

Deployments: `engine` (one `pdserve serve`). Others (1P1D of issue 29, replicas on Ray of issue
30) are DEPLOYMENTS entries: the servers to start, the URL bench sends to and the simulator's
placement flags; an entry whose commands this checkout lacks is listed as not measured."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

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
    sim_flags: tuple[str, ...]
    needs: str | None = None   # a `pdserve serve --help` flag this deployment's launch needs

    def missing(self) -> str | None:
        if self.needs is None:
            return None
        text = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--help"], capture_output=True,
                              text=True).stdout
        return None if self.needs in text else f"needs `pdserve serve {self.needs}`, not in this checkout"


DEPLOYMENTS = {
    "engine": Deployment("1 engine", ("--replicas", "1")),
    "1p1d": Deployment("1P1D", ("--prefill-replicas", "1", "--decode-replicas", "1"), needs="--role"),
    "ray2": Deployment("2 replicas (Ray)", ("--replicas", "2"), needs="--ray"),
}


def run_logged(cmd: list[str], log: str, timeout: float) -> int:
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode


def error_pct(measured: float, predicted: float) -> float | None:
    return None if not measured else 100.0 * (predicted - measured) / measured


def compare(measured: dict, predicted: dict[str, dict]) -> list[dict]:
    """Per metric: the measured value, and each prediction with its error."""
    return [{"metric": title, "measured": measured[key],
             **{f"predicted_{name}": p[key] for name, p in predicted.items()},
             **{f"error_pct_{name}": error_pct(measured[key], p[key]) for name, p in predicted.items()}}
            for key, title in METRICS]


def validate_model(label: str, model: str, kind: str, args, out_dir: str) -> list[dict]:
    from pdserve.config import ModelConfig
    vocab = ModelConfig.from_dir(model).vocab_size
    engine_flags = args.engine_args.split()
    py = [sys.executable, "-m", "pdserve"]
    cost_file = os.path.join(out_dir, f"{label}-cost-model.json")
    fit = py + ["simulate", "--fit-cost-model", "--save-cost-model", cost_file, "--model", model, "--num-prompts",
                "1", *engine_flags]

    def server_for(tag: str) -> tuple[servers.Server, str]:
        """A fresh server per workload, so its step log holds that run's steps only."""
        port, step_log = servers.free_port(), os.path.join(out_dir, f"{tag}-steps.jsonl")
        cmd = py + ["serve", "--model", model, "--port", str(port), "--log-level", "warning", "--step-log", step_log,
                    *engine_flags]
        return servers.Server(f"pdserve-{tag}", cmd, port, os.path.join(out_dir, f"{tag}-server.log")), step_log

    rows = []
    for key, dep in DEPLOYMENTS.items():
        if key != "engine":
            why = dep.missing()
            rows.append({"model": label, "deployment": dep.name, "workload": "-", "not_measured": why or
                         "its launch is not in this driver yet"})
            continue
        jobs = []
        for w in workloads(kind, args.quick):
            tag = f"{label}-{key}-{w.name.replace(' ', '_').replace('/', '-')}"
            server, step_log = server_for(tag)
            common = py + ["bench", "--base-url", server.base_url, "--vocab-size", str(vocab), "--disable-tqdm"]
            # the warm-up is a run of its own (other prompts), so the step log can be emptied after it
            warmup = common + ["--seed", str(SEED + 1), *w.flags, "--num-prompts", "2"]
            bench = common + ["--seed", str(SEED), "--output", os.path.join(out_dir, f"{tag}-bench.json"), *w.flags]
            sim = py + ["simulate", "--model", model, "--seed", str(SEED), *dep.sim_flags, *engine_flags, *w.flags]
            sims = {"prior": sim + ["--cost-model", cost_file, "--output", os.path.join(out_dir, f"{tag}-sim.json")],
                    "steps": sim + ["--step-log", step_log, "--output", os.path.join(out_dir, f"{tag}-sim-steps.json")]}
            jobs.append((w, tag, server, step_log, (warmup, bench), sims))
        if args.dry_run:
            print(" ".join(fit))
            for _, _, server, _, benches, sims in jobs:
                print(" ".join(server.cmd))
                for bench in benches:
                    print("  " + " ".join(bench))
                for sim in sims.values():
                    print("  " + " ".join(sim))
            continue
        t0 = time.monotonic()
        if run_logged(fit, os.path.join(out_dir, f"{label}-fit.log"), 900):
            raise RuntimeError(f"fitting the cost model failed: see {out_dir}/{label}-fit.log")
        print(f"{label}: cost model fitted ({time.monotonic() - t0:.0f} s)", flush=True)
        for w, tag, server, step_log, (warmup, bench), _ in jobs:
            if os.path.exists(step_log):
                os.remove(step_log)   # the server appends
            t0 = time.monotonic()
            with server.start(timeout=600):
                run_logged(warmup, os.path.join(out_dir, f"{tag}-warmup.log"), 900)
                with open(step_log, "r+") as f:   # the server appends (O_APPEND): it writes on from 0
                    f.truncate(0)
                rc = run_logged(bench, os.path.join(out_dir, f"{tag}-bench.log"), 900)
            print(f"{label} {w.name}: bench exit {rc} ({time.monotonic() - t0:.0f} s)", flush=True)
        for w, tag, _, _, _, sims in jobs:
            predicted = {}
            for name, sim in sims.items():
                if run_logged(sim, os.path.join(out_dir, f"{tag}-sim-{name}.log"), 900):
                    raise RuntimeError(f"pdserve simulate failed: see {out_dir}/{tag}-sim-{name}.log")
                with open(sim[-1]) as f:
                    predicted[name] = json.load(f)
            with open(os.path.join(out_dir, f"{tag}-bench.json")) as f:
                measured = json.load(f)
            rows.append({"model": label, "deployment": dep.name, "workload": w.name, "failed": measured["failed"],
                         "metrics": compare(measured, predicted)})
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
            lines.append(f"| {r['model']} | {r['deployment']} | {r['workload']} | {m['metric']} | {m['measured']:.2f} | "
                         f"{m['predicted_prior']:.2f} | {err(m['error_pct_prior'])} | {m['predicted_steps']:.2f} | "
                         f"{err(m['error_pct_steps'])} |")
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
