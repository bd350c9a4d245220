"""Predictions for deployments this machine cannot run: `pdserve simulate --search` for 1 to 64
machines, with the step-time model fitted on this machine (from benchmarks.sim_validate) and
with a GPU's datasheet rates, as a Markdown table. Every figure is a PREDICTION of the
simulator, not a measurement.

    python -m benchmarks.sim_predict --model /work/q05 --cost-model benchmarks/results/sim/0.5b-cost-model.json
    python -m benchmarks.sim_predict --model /work/q05 --gpu h100 --machines 1,2,4,8
    python -m benchmarks.sim_predict --dry-run"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from pdserve.engine.args import DEFAULT_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MACHINES = "1,2,4,8,16,32,64"
# (workload flags, goodput SLOs): a CPU step of the 0.5B model takes ~0.1-1 s, an H100's milliseconds
CPU = (("--random-input-len", "256", "--random-output-len", "32"), ("ttft:4000", "tpot:400"))
GPU = (("--random-input-len", "1024", "--random-output-len", "128"), ("ttft:200", "tpot:8"))


def command(args, kind: str, out: str) -> list[str]:
    flags, slos = GPU if kind != "fitted" else CPU
    model_flags = ["--gpu", args.gpu] if kind != "fitted" else ["--cost-model", args.cost_model]
    return [sys.executable, "-m", "pdserve", "simulate", "--model", args.model, *model_flags, *flags,
            "--search", "--machines", args.machines, "--num-prompts", str(args.prompts_per_machine),
            "--goodput", *(args.goodput or slos), "--output", out, *args.sim_args.split()]


def markdown(result: dict) -> str:
    lines = [f"PREDICTIONS ({result['step_time']}); SLOs {result['goodput_slos_ms']}:", "",
             "| machines | best placement | its max rate (req/s) | per machine | colocated per machine | "
             "best xPyD | xPyD per machine |", "|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"   # noqa: E731
    for machines, rows in result["search"].items():
        best = rows[0]
        colo = next(r for r in rows if not r["prefill"])
        pd = next((r for r in rows if r["prefill"]), None)
        lines.append(f"| {machines} | {best['placement']} | {fmt(best['max_rate'])} | {fmt(best['goodput_per_machine'])} "
                     f"| {fmt(colo['goodput_per_machine'])} | {pd['placement'] if pd else '-'} | "
                     f"{fmt(pd['goodput_per_machine']) if pd else '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model whose config shapes the prediction")
    p.add_argument("--cost-model", default=None, help="a fitted step-time model (benchmarks.sim_validate writes one)")
    p.add_argument("--gpu", default=None, choices=("a100", "h100", "h200"))
    p.add_argument("--machines", default=MACHINES)
    p.add_argument("--prompts-per-machine", type=int, default=40)
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="(default: per step-time model)")
    p.add_argument("--sim-args", default="", help="extra `pdserve simulate` flags, one string")
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    kinds = (["fitted"] if args.cost_model else []) + ([args.gpu] if args.gpu else [])
    if not kinds:
        p.error("give --cost-model FILE and/or --gpu NAME")
    os.makedirs(os.path.join(args.results, "sim"), exist_ok=True)
    for kind in kinds:
        out = os.path.join(args.results, "sim", f"predict-{kind}.json")
        cmd = command(args, kind, out)
        print(" ".join(cmd), flush=True)
        if args.dry_run:
            continue
        rc = subprocess.run(cmd, stdout=sys.stderr).returncode
        if rc:
            return rc
        with open(out) as f:
            print(markdown(json.load(f)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
